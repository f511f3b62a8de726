"""Compile the same train step with mxc and with MaxText's train_compile, one after the other, and
compare CPU-seconds, wall time and peak RSS.

    python bench/compile_vs_maxtext.py [--model llama3.1-8b] [--topology v5p-1024] [--runs 3]
        [--maxtext-python /tmp/maxtext-venv/bin/python] [--json]

Both compile one train step for the same topology through libtpu on this host, with MaxText's
recipe: pure FSDP over every chip (`--pin fsdp=N` for mxc's planner), `minimal` remat, 4
sequences of 4096 tokens per chip, splash (flash) attention. mxc compiles only its train step
here (`--functions train_step`), as train_compile does, and skips its compile cache. MaxText
lives in its own Python 3.12 environment:

    ~/.pyenv/versions/3.12.1/bin/python -m venv /tmp/maxtext-venv
    /tmp/maxtext-venv/bin/pip install 'maxtext[tpu]==0.2.5'

Each tool runs as its users get it: `mxc compile` on jemalloc where the host has it
(mxc.compiler.allocator), MaxText on the system allocator. To run both on the same allocator, start
this script with LD_PRELOAD=libjemalloc.so.2 (and MALLOC_CONF as wanted): both children inherit it.

Each tool runs as a child process measured with wait4: CPU-seconds are user + system time of
the process and everything it waited for. On a shared host they still move by up to a tenth
between runs of the same command (other tenants' load slows the same work), so with `--runs N`
the two tools alternate N times and the ratios are those of the medians. Run it on a quiet machine
for wall times that mean something.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MXC = Path(sys.executable).with_name("mxc")
MAXTEXT_MODEL_NAMES = {"llama3.1-8b": "llama3.1-8b", "llama3-8b": "llama3-8b", "llama3.1-70b": "llama3.1-70b"}


@dataclass(frozen=True)
class Measurement:
    tool: str
    cpu_seconds: float
    wall_seconds: float
    peak_rss_bytes: int
    exit_status: int
    log_tail: str


def measure(tool: str, command: list[str], env: dict, cwd: Path | None = None) -> Measurement:
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read()[-3000:]
    # ru_maxrss is in KiB on Linux: the largest resident set of the child or its descendants.
    return Measurement(tool, usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss * 1024, process.returncode, tail)


def median_of(measurements: list[Measurement]) -> dict[str, float]:
    return {key: statistics.median(getattr(m, key) for m in measurements)
            for key in ("cpu_seconds", "wall_seconds", "peak_rss_bytes")}


def chips_of(topology: str) -> int:
    from mxc.compiler.topology import parse

    return parse(topology).chips


def run_mxc(args, work: Path) -> Measurement:
    """MaxText's recipe pinned for the planner: every chip on the fsdp axis, the same remat."""
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "MXC_CACHE_DIR": str(work / "mxc-cache")}
    chips = chips_of(args.topology)
    command = [str(MXC), "compile", args.model, "--topology", args.topology, "--pin", f"fsdp={chips}",
               "--remat", args.remat, "--seq", str(args.seq), "--batch", str(args.per_chip * chips),
               "--functions", "train_step", "--no-cache", "-o", str(work / "mxc-artifact"), "--json"]
    return measure("mxc", command, env)


def run_maxtext(args, work: Path) -> Measurement:
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)
    command = [args.maxtext_python, "-m", "maxtext.trainers.pre_train.train_compile",
               "maxtext/configs/base.yml", f"compile_topology={args.topology}", "compile_topology_num_slices=1",
               f"model_name={MAXTEXT_MODEL_NAMES[args.model]}", f"per_device_batch_size={args.per_chip}",
               f"max_target_length={args.seq}", f"remat_policy={args.remat}", "ici_fsdp_parallelism=-1",
               "dataset_type=synthetic", "enable_checkpointing=false", f"base_output_directory={work}",
               "run_name=bench",
               # MaxText keeps JAX's persistent compilation cache in ~/jax_cache by default; an empty
               # one per run makes it compile cold, as mxc does with --no-cache.
               f"jax_cache_dir={work / 'maxtext-jax-cache'}"]
    site = subprocess.run([args.maxtext_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                          capture_output=True, text=True, env=env)
    if site.returncode != 0:
        return Measurement("maxtext", 0.0, 0.0, 0, site.returncode, site.stderr[-3000:])
    # train_compile reads its base config relative to the package's parent directory.
    return measure("maxtext", command, env, cwd=Path(site.stdout.strip()).parent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b", choices=sorted(MAXTEXT_MODEL_NAMES))
    parser.add_argument("--topology", default="v5p-1024")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--per-chip", type=int, default=4, help="sequences per chip")
    parser.add_argument("--remat", default="minimal")
    parser.add_argument("--maxtext-python", default="/tmp/maxtext-venv/bin/python")
    parser.add_argument("--skip-maxtext", action="store_true")
    parser.add_argument("--runs", type=int, default=1, help="alternating runs of each tool (medians compared)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    runs = []  # [(mxc, maxtext or None)], alternating so that both see the same hours of the host
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="mxc-bench-") as scratch:
            work = Path(scratch)
            mxc = run_mxc(args, work)
            runs.append((mxc, None if args.skip_maxtext else run_maxtext(args, work)))
    results = [r for pair in runs for r in pair if r is not None]
    report = {"model": args.model, "topology": args.topology, "seq": args.seq, "per_chip": args.per_chip,
              "remat": args.remat, "results": [asdict(r) for r in results]}
    ok = all(r.exit_status == 0 for r in results)
    if ok and not args.skip_maxtext:
        report["medians"] = {tool: median_of([pair[i] for pair in runs]) for i, tool in enumerate(("mxc", "maxtext"))}
        mxc, maxtext = report["medians"]["mxc"], report["medians"]["maxtext"]
        report["ratios"] = {"cpu_seconds": mxc["cpu_seconds"] / maxtext["cpu_seconds"],
                            "wall_seconds": mxc["wall_seconds"] / maxtext["wall_seconds"],
                            "peak_rss": mxc["peak_rss_bytes"] / maxtext["peak_rss_bytes"]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.model} on {args.topology}: {args.per_chip} x {args.seq} per chip, remat {args.remat}")
        print(f"{'tool':<12}{'CPU-s':>9}{'wall s':>9}{'peak RSS':>11}  status")
        for r in results:
            print(f"{r.tool:<12}{r.cpu_seconds:9.1f}{r.wall_seconds:9.1f}"
                  f"{r.peak_rss_bytes / 2**30:9.3f} GiB  {r.exit_status}")
        if "ratios" in report:
            ratios = report["ratios"]
            label = "mxc/MaxText" if args.runs == 1 else "medians"
            print(f"{label:<12}{ratios['cpu_seconds']:9.3f}{ratios['wall_seconds']:9.3f}"
                  f"{ratios['peak_rss']:11.3f}")
        for r in results:
            if r.exit_status != 0:
                print(f"\n{r.tool} failed (exit {r.exit_status}):\n{r.log_tail}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
