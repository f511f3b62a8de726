"""Shared by the runtime's end-to-end tests: a tiny compiled artifact, a text corpus, commands.

The artifact is compiled in a child process by `mxc compile` itself (8 virtual CPU devices), with
one change: a learning-rate schedule sized for a 60-step run (the command has no optimizer flags
yet, and its default warms up over 1,000 steps). The session's compile cache (conftest.py) makes
later tests of the same session reuse it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PYTHON = sys.executable
MXC = str(Path(sys.executable).with_name("mxc"))
CHILDREN = Path(__file__).parent / "children"
STEPS = 60
SEQ, BATCH = 64, 8
SERVE_BATCH, PROMPT_LEN, CACHE_LEN = 8, 4, 64
# Warm up over 5 steps to a peak that moves a 2-layer d_model-64 model within 60 steps.
OPTIMIZER = {"learning_rate": 3e-3, "total_steps": STEPS, "warmup_steps": 5}


def child(name: str, *args: str) -> list[str]:
    """The command that runs the child program tests/children/NAME.py with ARGS."""
    return [PYTHON, str(CHILDREN / f"{name}.py"), *map(str, args)]


def cpu_env(devices: int | None = None, **extra: str) -> dict:
    """An environment for a child process on CPU only; `devices` virtual devices if given (else
    the runtime chooses them from the artifact). It keeps this session's MXC_CACHE_DIR (set by
    conftest.py), so children never share the user's compile cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", **extra)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def compile_tiny(destination: Path, *, pins: tuple[str, ...] = (), model: str = "llama3-tiny") -> Path:
    """`mxc compile MODEL --topology cpu-8 --serve ...` with the 60-step schedule; `pins` fix mesh
    axes for the planner (AXIS=N)."""
    arguments = ["compile", model, "--topology", "cpu-8", "--seq", str(SEQ), "--batch", str(BATCH), "--serve",
                 "--serve-batch", str(SERVE_BATCH), "--prompt-len", str(PROMPT_LEN), "--cache-len", str(CACHE_LEN),
                 "-o", str(destination), "--force"]
    for pin in pins:
        arguments += ["--pin", pin]
    done = subprocess.run(child("compile_with_schedule", json.dumps(OPTIMIZER), *arguments), env=cpu_env(8),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return destination


def corpus_files() -> list[str]:
    """Plain English-and-code text that ships with every Python: the same bytes in every run."""
    library = Path(sysconfig.get_paths()["stdlib"])
    files = [library / name for name in ("argparse.py", "textwrap.py", "this.py")]
    return [str(f) for f in files]


def tokenize(inputs: list[str], output: Path) -> Path:
    done = subprocess.run([MXC, "tokenize", *inputs, "-o", str(output)], env=cpu_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return output


def run_command(artifact: Path, data: Path, ckpt: Path, *, steps: int = STEPS, metrics: Path | None = None,
                extra: list[str] = ()) -> list[str]:
    command = [MXC, "run", str(artifact), "--data", str(data), "--steps", str(steps), "--ckpt-dir", str(ckpt)]
    if metrics is not None:
        command += ["--metrics", str(metrics)]
    return command + list(extra)


def read_metrics(path: Path, kind: str = "train") -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return [r for r in records if r.get("kind") == kind]


def wait_for_step(process: subprocess.Popen, metrics: Path, step: int, timeout: float = 300) -> int:
    """Polls the metrics file until it reports `step` (or later); returns the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(metrics)
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        if process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before step {step}: "
                                 f"{process.stderr.read() if process.stderr else ''}")
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restore_on_one_device(ckpt_dir: Path, step: int, item: str = "params"):
    """A checkpoint item on this process's first device, whatever mesh it was saved from."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(ckpt_dir).absolute() / str(step) / item
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(path)
    metadata = getattr(metadata, "item_metadata", metadata)
    metadata = getattr(metadata, "tree", metadata)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    return checkpointer.restore(path, target)
