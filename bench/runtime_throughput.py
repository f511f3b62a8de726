"""Training throughput (tokens/s) on this machine's CPU: `mxc run` with a precompiled artifact
against HuggingFace transformers with torch's AdamW training the same network (bench/torch_train.py),
and MaxText training the same configuration when a MaxText installation is given.

Each side runs `--steps` steps in a fresh process; its rate is batch x seq over the median
seconds of the steps after the first `--skip` (which pay for warming up). mxc's step seconds
come from the metrics lines `mxc run` writes. The sides alternate for `--rounds` rounds, so a
busy moment of the shared machine hits both; the ratios are those of the medians over rounds.
Both sides also report their process's CPU seconds per step (`ratio_per_cpu_second`): on a
machine shared with other jobs the wall time measures the sharing as much as the program.
MaxText: `python -m MaxText.train` with the same dimensions, sequence length, batch, synthetic
data and no checkpoints; its per-step figures come from its metrics file. All use the CPU
(`local`, JAX_PLATFORMS=cpu). `--model` picks a preset of runtime_common.MODELS.

    .venv/bin/python bench/runtime_throughput.py [--model llama-20m] [--seq 256] [--batch 8]
        [--steps 40] [--skip 10] [--rounds 3] [--maxtext-python /tmp/maxtext-venv/bin/python]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runtime_common import (MODELS, PYTHON, BenchModel, byte_tokens, compile_artifact, cpu_env,  # noqa: E402
                            machine, read_metrics, write_spec)

from mxc.runtime import allocator  # noqa: E402


def maxtext_model(model: BenchModel) -> dict:
    """The bench model's dimensions in MaxText's config keys (MaxText/configs/base.yml)."""
    return {"base_emb_dim": model.d_model, "base_num_query_heads": model.heads, "base_num_kv_heads": model.kv_heads,
            "head_dim": model.head_dim, "base_mlp_dim": model.hidden, "base_num_decoder_layers": model.layers,
            "vocab_size": model.vocab, "logits_via_embedding": model.tied, "dtype": "float32",
            "weight_dtype": "float32", "rope_max_timescale": int(model.rope_theta)}


def mxc_artifact(model: BenchModel, work: Path, seq: int, batch: int) -> tuple[Path, Path, float]:
    spec = write_spec(work, model.mspec(), model.name)
    artifact, compile_seconds = compile_artifact(spec, work / "artifact", seq=seq, batch=batch)
    return artifact, byte_tokens(work), compile_seconds


def rates(step_seconds: list[float], tokens_per_step: int, skip: int, wall: float,
          cpu_seconds: list[float] | None = None) -> dict:
    """The median step's rate; with the process's CPU seconds per step, also tokens per CPU-second,
    which other jobs on a shared machine move less than the wall time (each side uses every core)."""
    median = statistics.median(step_seconds[skip:])
    result = {"tokens_per_second": round(tokens_per_step / median, 1), "step_seconds": round(median, 4),
              "run_wall_seconds": round(wall, 1)}
    if cpu_seconds and all(c is not None for c in cpu_seconds[skip:]):
        cpu = statistics.median(cpu_seconds[skip:])
        result.update(cpu_seconds=round(cpu, 4), tokens_per_cpu_second=round(tokens_per_step / cpu, 1))
    return result


def mxc_throughput(artifact: Path, tokens: Path, work: Path, steps: int, skip: int, tokens_per_step: int) -> dict:
    metrics = work / "mxc.jsonl"
    metrics.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as ckpt:
        started = time.perf_counter()
        subprocess.run([PYTHON, "-m", "mxc.runtime", "run", str(artifact), "--data", str(tokens), "--steps",
                        str(steps), "--ckpt-dir", ckpt, "--metrics", str(metrics), "--quiet"],
                       env=cpu_env(), check=True, capture_output=True, timeout=7200)
        wall = time.perf_counter() - started
    records = read_metrics(metrics)
    return rates([r["step_seconds"] for r in records], tokens_per_step, skip, wall,
                 [r.get("cpu_seconds") for r in records])


def torch_throughput(model: BenchModel, work: Path, seq: int, batch: int, steps: int, skip: int) -> dict:
    config = work / "hf_config.json"
    config.write_text(json.dumps(model.hf_config()))
    started = time.perf_counter()
    done = subprocess.run([PYTHON, str(Path(__file__).with_name("torch_train.py")), str(config), "--batch", str(batch),
                           "--seq", str(seq), "--steps", str(steps)],
                          env=cpu_env(), check=True, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - started
    measured = json.loads(done.stdout)
    return rates(measured["step_seconds"], batch * seq, skip, wall, measured.get("cpu_seconds"))


# MaxText's trainer module and the package holding configs/base.yml: 0.2.5's layout, then the
# older top-level `MaxText` one.
MAXTEXT_LAYOUTS = (("maxtext.trainers.pre_train.train", "maxtext"), ("MaxText.train", "MaxText"))

_FIND_MAXTEXT = """
import importlib, importlib.util, os, sys
for module, package in {layouts}:
    if importlib.util.find_spec(package) is not None and importlib.util.find_spec(module) is not None:
        print(module, os.path.dirname(importlib.import_module(package).__file__))
        sys.exit(0)
sys.exit(1)
"""


# mxc's remat policy names -> MaxText's, where both have it (compiler/lower/remat.py).
# MaxText has no "no remat"; its least recomputing policy is "minimal_with_context".
MAXTEXT_REMAT = {"full": "full", "minimal": "minimal", "save_qkv": "save_qkv_proj", "attention_out": "save_out_proj",
                 "none": "minimal_with_context"}


def planned_remat(artifact: Path) -> str:
    return json.loads((artifact / "manifest.json").read_text())["plan"]["remat"]


def maxtext_throughput(python: str, model: BenchModel, work: Path, seq: int, batch: int, steps: int,
                       remat: str) -> dict:
    """MaxText's own trainer on the same configuration; its metrics file gives per-step figures."""
    found = subprocess.run([python, "-c", _FIND_MAXTEXT.format(layouts=MAXTEXT_LAYOUTS)], capture_output=True,
                           text=True, env=cpu_env())
    if found.returncode != 0:
        return {"error": f"{python} has no MaxText trainer ({', '.join(m for m, _ in MAXTEXT_LAYOUTS)}): "
                         f"{found.stderr.strip()[-500:]}"}
    module, package_dir = found.stdout.split()
    metrics = work / "maxtext_metrics.txt"
    metrics.unlink(missing_ok=True)
    overrides = {"run_name": "mxc-bench", "base_output_directory": str(work / "maxtext"), "dataset_type": "synthetic",
                 "steps": steps, "enable_checkpointing": False, "per_device_batch_size": batch,
                 "max_target_length": seq, "metrics_file": str(metrics), "hardware": "cpu",
                 # One process: nothing to coordinate (MaxText's CPU start-up otherwise expects a job index).
                 "skip_jax_distributed_system": True, **maxtext_model(model),
                 # The same trade of memory for recomputation as the artifact's plan.
                 "remat_policy": MAXTEXT_REMAT.get(remat, "full")}
    command = [python, "-m", module, str(Path(package_dir) / "configs" / "base.yml"),
               *(f"{k}={v}" for k, v in overrides.items())]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=7200, env=cpu_env())
    wall = time.perf_counter() - started
    if done.returncode != 0 or not metrics.exists():
        return {"error": f"{module} failed ({done.returncode}): {done.stderr.strip()[-1500:]}", "command": command}
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [line["perf/per_device_tokens_per_sec"] for line in lines[2:] if "perf/per_device_tokens_per_sec" in line]
    times = [line["perf/step_time_seconds"] for line in lines[2:] if "perf/step_time_seconds" in line]
    return {"tokens_per_second": statistics.median(rates),
            "step_seconds": statistics.median(times) if times else None,
            "run_wall_seconds": round(wall, 1), "command": " ".join(command)}


def training_allocator() -> str:
    """The allocator `mxc run` restarts on (mxc.runtime.allocator): it moves a CPU step's time."""
    chosen = cpu_env().get(allocator.ENV_CHOICE, "jemalloc") == "jemalloc" and allocator.find_jemalloc()
    return "jemalloc, freed pages kept" if chosen else "system"


def median_of(runs: list[dict], key: str = "tokens_per_second") -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-20m")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the rate (warming up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--maxtext-python", default="/tmp/maxtext-venv/bin/python",
                        help="a Python with MaxText installed (default: /tmp/maxtext-venv/bin/python)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip must leave steps to measure: 0 <= {args.skip} < --steps {args.steps}")
    model = MODELS[args.model]
    work = Path(args.work or tempfile.mkdtemp(prefix="mxc-bench-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    artifact, tokens, compile_seconds = mxc_artifact(model, work, args.seq, args.batch)
    has_maxtext = Path(args.maxtext_python).exists()
    tokens_per_step = args.batch * args.seq
    mxc_runs, torch_runs, maxtext_runs = [], [], []
    for _ in range(args.rounds):  # interleaved, so a busy moment of the machine hits every side
        mxc_runs.append(mxc_throughput(artifact, tokens, work, args.steps, args.skip, tokens_per_step))
        torch_runs.append(torch_throughput(model, work, args.seq, args.batch, args.steps, args.skip))
        if has_maxtext:
            maxtext_runs.append(maxtext_throughput(args.maxtext_python, model, work, args.seq, args.batch, args.steps,
                                                   planned_remat(artifact)))
        print(f"mxc {mxc_runs[-1]}; transformers {torch_runs[-1]}; maxtext {maxtext_runs[-1] if maxtext_runs else None}",
              file=sys.stderr)
    result = {"model": f"{args.model} ({model.parameters() / 1e6:.2f}M parameters, float32)", "seq": args.seq,
              "batch": args.batch, "steps": args.steps, "measured_steps": f"{args.skip}-{args.steps - 1}",
              "rounds": args.rounds,
              "mxc": {"tokens_per_second": median_of(mxc_runs), "compile_seconds": round(compile_seconds, 1),
                      "remat": planned_remat(artifact), "allocator": training_allocator(), "runs": mxc_runs},
              "transformers": {"tokens_per_second": median_of(torch_runs), "runs": torch_runs}}
    result["ratio_mxc_over_transformers"] = round(median_of(mxc_runs) / median_of(torch_runs), 2)
    if all("tokens_per_cpu_second" in r for r in mxc_runs + torch_runs):
        result["ratio_per_cpu_second"] = round(median_of(mxc_runs, "tokens_per_cpu_second")
                                               / median_of(torch_runs, "tokens_per_cpu_second"), 2)
    if not has_maxtext:
        result["maxtext"] = {"error": f"no MaxText installation at {args.maxtext_python}"}
    elif any("error" in r for r in maxtext_runs):
        result["maxtext"] = next(r for r in maxtext_runs if "error" in r)
    else:
        result["maxtext"] = {"tokens_per_second": median_of(maxtext_runs), "runs": maxtext_runs}
        result["ratio_mxc_over_maxtext"] = round(median_of(mxc_runs) / median_of(maxtext_runs), 2)
    result["machine"] = machine()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
