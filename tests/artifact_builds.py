"""Artifacts shared by test_artifact.py and test_compile.py, each compiled once per test session
by the installed `mxc` command in its own process (a cpu-N compile needs XLA_FLAGS set before
jax is imported, which this pytest process has already done), and the helpers that run child
processes for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime_support import child

MXC = Path(sys.executable).with_name("mxc")

# XLA:CPU's backend optimisations cost most of a tiny model's compile time and change nothing
# these tests check (the compile and the reference run in processes with the same flags).
FAST_CPU_FLAGS = "--xla_backend_optimization_level=0"

# Pinned to pure FSDP, so that the tests know every leaf's sharding.
TINY_CPU8 = ["llama3-tiny", "--topology", "cpu-8", "--seq", "32", "--batch", "8", "--pin", "fsdp=8", "--serve",
             "--cache-len", "32"]
TINY_V5P8 = ["llama3-tiny", "--topology", "v5p-8", "--seq", "64", "--batch", "16", "--pin", "fsdp=4"]

_built: dict[tuple, Path] = {}


def clean_env(base: Path, **extra: str) -> dict:
    """The environment of a child process: this session's caches, no inherited device flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "MXC_DEBUG")}
    env.update({"MXC_CACHE_DIR": str(base / "mxc-cache"), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                "XLA_FLAGS": FAST_CPU_FLAGS, **extra})
    return env


def run_mxc(base: Path, *args: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    """`mxc ARGS` in a child process with clean_env(base), plus `env`."""
    return subprocess.run([str(MXC), *args], capture_output=True, text=True, env=clean_env(base, **env),
                          timeout=timeout)


def child_report(program: str, *args: str, env: dict | None = None, timeout: int = 900, **extra: str) -> dict:
    """A child program run with ARGS: tests/children/PROGRAM.py, or a test module given by its path
    (one that runs its own check under `__main__`), in environment `env` (default: this one) plus
    `extra` (device flags must be set before jax is imported): the JSON object it prints last."""
    command = [sys.executable, program, *args] if program.endswith(".py") else child(program, *args)
    done = subprocess.run(command, env={**(os.environ if env is None else env), **extra}, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def built(base: Path, args: list[str]) -> Path:
    """The artifact `mxc compile ARGS` writes, compiled on first use."""
    key = (str(base), tuple(args))
    if key not in _built:
        name = "-".join(a.strip("-") for a in args[:3] if not a.startswith("--"))
        output = base / "artifacts" / name
        done = run_mxc(base, "compile", *args, "-o", str(output), "--json")
        assert done.returncode == 0, done.stderr[-4000:]
        summary = json.loads(done.stdout)
        assert summary["cached"] is False
        _built[key] = output
    return _built[key]


def rewrite_manifest(directory: Path, mutate) -> dict:
    """Edit a manifest as a tool that knows the format would (its self-hash kept valid), so that
    the check under test, not the integrity check, is what refuses it."""
    from mxc.runtime.artifact import manifest_digest

    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    mutate(data)
    data["manifest_sha256"] = manifest_digest(data)
    path.write_text(json.dumps(data, indent=2))
    return data
