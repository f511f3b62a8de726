"""Start-up time: from process start to the first finished train step, for a ~100M-parameter Llama,
with the precompiled artifact against a plain `jax.jit` of the same step.

Headline: `mxc run ARTIFACT --steps 1` (the product path, checkpoint and metrics included) against
a script that jits the compiler's own init and train step for the same spec, plan, shapes and
device, both timed from the moment the process is spawned to the first step's metrics on the
host. Both read the same first batch from the same token file, so their first losses must agree.
A second pair of child processes reports where the time goes (imports, load or compile, init,
the step itself). The artifact is compiled once beforehand; that cost is paid once per model and
topology, not per job, and is reported too.

    .venv/bin/python bench/runtime_startup.py [--seq 64] [--batch 1] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runtime_common import (LLAMA_100M, PYTHON, byte_tokens, compile_artifact, cpu_env, machine,  # noqa: E402
                            read_metrics, write_spec)

# What a training script without mxc's AOT does: the compiler's functions for this spec, the
# artifact's plan and these shapes, jitted with the same shardings; init, then one step on the
# token file's first batch.
_JIT_FIRST_STEP = textwrap.dedent("""
    import json, sys, time
    marks = {"start": time.time()}
    import jax, numpy as np
    from jax.sharding import Mesh
    from mxc.compiler.aot import RunConfig, model_functions
    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.plan import Plan
    from mxc.runtime.data import BatchLayout, TrainData
    from mxc.runtime.token_file import open_tokens
    from mxc.spec.load import load_model
    marks["imported"] = time.time()

    spec_path, tokens_path, manifest_path, seq, batch = sys.argv[1:4] + [int(a) for a in sys.argv[4:6]]
    spec = load_model(spec_path)
    manifest = json.load(open(manifest_path))  # the plan the artifact was compiled with, for the same program
    plan = Plan.model_validate(manifest["plan"])
    mesh_shape = manifest["topology"]["mesh"]
    mesh = Mesh(np.array(jax.devices()).reshape(tuple(mesh_shape.values())), tuple(mesh_shape))
    functions = {f.name: f for f in model_functions(spec, plan, mesh, RunConfig(seq=seq, batch=batch))}

    def jitted(name):
        f = functions[name]
        with use_rules(mesh, plan.rules):
            out = jax.eval_shape(f.fn, *f.args)
        return jax.jit(f.fn, in_shardings=f.in_shardings, out_shardings=f.out_shardings(out), donate_argnums=f.donate)

    layout = BatchLayout(batch, seq, functions["train_step"].in_shardings[1]["inputs"])
    first_batch = TrainData(open_tokens(tokens_path), layout, seed=0, vocab_size=spec.vocab).next_batch()
    with use_rules(mesh, plan.rules):
        init = jitted("init").lower(*functions["init"].args).compile()
        train_step = jitted("train_step").lower(*functions["train_step"].args).compile()
        marks["compiled"] = time.time()
        state = jax.block_until_ready(init(np.int32(0)))
        marks["initialised"] = time.time()
        state, metrics = train_step(state, first_batch, {"learning_rate": np.float32(3e-4)})
        loss = float(metrics["loss"])
    marks["first_step"] = time.time()
    print(json.dumps({"marks": marks, "loss": loss}))
""")

# The artifact's path through the same phases, with the runtime's own API.
_ARTIFACT_FIRST_STEP = textwrap.dedent("""
    import json, sys, time
    marks = {"start": time.time()}
    import jax, numpy as np
    from mxc.runtime.data import TrainData
    from mxc.runtime.program import load
    from mxc.runtime.token_file import open_tokens
    from mxc.runtime.trainable import from_program
    marks["imported"] = time.time()
    trainable = from_program(load(sys.argv[1]))
    first_batch = TrainData(open_tokens(sys.argv[2]), trainable.layout, seed=0).next_batch()
    marks["compiled"] = time.time()  # loaded and bound: the artifact's stand-in for compiling
    state = jax.block_until_ready(trainable.init(0))
    marks["initialised"] = time.time()
    state, metrics = trainable.train_step(state, first_batch, {"learning_rate": np.float32(3e-4)})
    loss = float(metrics["loss"])
    marks["first_step"] = time.time()
    print(json.dumps({"marks": marks, "loss": loss}))
""")


def mxc_run_first_step(artifact: Path, tokens: Path, work: Path) -> tuple[float, float]:
    """(seconds from spawn to the first step's metrics line, its loss) for `mxc run --steps 1`."""
    metrics = work / "metrics.jsonl"
    with tempfile.TemporaryDirectory(dir=work) as ckpt:
        started = time.time()
        subprocess.run([PYTHON, "-m", "mxc.runtime", "run", str(artifact), "--data", str(tokens), "--steps", "1",
                        "--ckpt-dir", ckpt, "--metrics", str(metrics), "--quiet"],
                       env=cpu_env(), check=True, capture_output=True, timeout=3600)
    first = read_metrics(metrics)[0]
    return first["time"] - started, first["loss"]


def phases(script: str, *arguments: str) -> dict:
    """Spawn-to-first-step seconds of a child script, and the seconds of each phase."""
    spawned = time.time()
    done = subprocess.run([PYTHON, "-c", script, *arguments], env=cpu_env(), check=True, capture_output=True,
                          text=True, timeout=3600)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    marks = {"spawned": spawned, **result["marks"]}
    names = list(marks)
    steps = {f"{b}": round(marks[b] - marks[a], 2) for a, b in zip(names, names[1:])}
    return {"total": round(marks["first_step"] - spawned, 2), "phases": steps, "loss": result["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="mxc-bench-startup-"))
    spec = write_spec(work, LLAMA_100M, "bench-llama-100m")
    tokens = byte_tokens(work)
    artifact, compile_seconds = compile_artifact(spec, work / "artifact", seq=args.seq, batch=args.batch)
    print(f"compiled the artifact once in {compile_seconds:.1f} s", file=sys.stderr)
    runs, jit_runs, artifact_phases, jit_phases = [], [], [], []
    for repeat in range(args.repeats):  # interleaved, so a busy moment of the machine hits both sides
        runs.append(mxc_run_first_step(artifact, tokens, work))
        jit_phases.append(phases(_JIT_FIRST_STEP, str(spec), str(tokens), str(artifact / "manifest.json"),
                                 str(args.seq), str(args.batch)))
        artifact_phases.append(phases(_ARTIFACT_FIRST_STEP, str(artifact), str(tokens)))
        print(f"repeat {repeat + 1}: mxc run {runs[-1][0]:.1f} s; jit {jit_phases[-1]}; "
              f"artifact {artifact_phases[-1]}", file=sys.stderr)
    mxc_run = statistics.median(seconds for seconds, _ in runs)
    jit = statistics.median(p["total"] for p in jit_phases)
    result = {
        "model": "bench-llama-100m (100M parameters)", "seq": args.seq, "batch": args.batch,
        "artifact_compile_seconds": round(compile_seconds, 2),
        "mxc_run_first_step_seconds": [round(seconds, 2) for seconds, _ in runs],
        "jit_first_step_seconds": [p["total"] for p in jit_phases],
        "speedup": round(jit / mxc_run, 2),
        "phases": {"artifact": artifact_phases, "jit": jit_phases},
        "first_losses": {"mxc_run": runs[0][1], "jit": jit_phases[0]["loss"], "artifact": artifact_phases[0]["loss"]},
        "machine": machine(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
