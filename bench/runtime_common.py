"""Shared by the runtime benchmarks: bench models as .mspec text, and running mxc as a user does.

Every measurement runs in a fresh child process, as a user's command would, on this machine's
CPU (`local`: the one CPU device, JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PYTHON = sys.executable
MXC = str(Path(sys.executable).with_name("mxc"))

def _bench_llama(name: str, d_model: int, heads: int, head_dim: int, hidden: int) -> str:
    """A Llama 3-shaped bench model: tied 32k embedding, 12 layers, GQA with 4 KV heads."""
    return f"""
model {name} {{
  vocab = 32000
  d_model = {d_model}
  max_seq = 2048
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = float32
  block x 12 {{
    attention = gqa(heads = {heads}, kv_heads = 4, head_dim = {head_dim}, rope = rope(theta = 500000))
    mlp = glu(hidden = {hidden}, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }}
}}
"""


# ~110M parameters: GPT-2-small-sized Llama (d_model 768).
LLAMA_100M = _bench_llama("bench-llama-100m", d_model=768, heads=12, head_dim=64, hidden=2048)

# ~20M parameters: a small Llama 3 (d_model 256).
LLAMA_20M = _bench_llama("bench-llama-20m", d_model=256, heads=8, head_dim=32, hidden=1024)


def cpu_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", **extra)
    return env


def write_spec(directory: Path, text: str, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.mspec"
    path.write_text(text)
    return path


def run(command: list[str], *, timeout: float = 3600, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def compile_artifact(spec: Path, output: Path, *, seq: int, batch: int, extra: list[str] = ()) -> tuple[Path, float]:
    started = time.perf_counter()
    run([MXC, "compile", str(spec), "--topology", "local", "--seq", str(seq), "--batch", str(batch),
         "-o", str(output), "--force", *extra])
    return output, time.perf_counter() - started


def byte_tokens(directory: Path) -> Path:
    """A token file of English and code that ships with Python (the same bytes on every machine)."""
    library = Path(sysconfig.get_paths()["stdlib"])
    inputs = [str(library / name) for name in ("argparse.py", "textwrap.py", "typing.py", "this.py")]
    output = directory / "tokens.bin"
    run([MXC, "tokenize", *inputs, "-o", str(output)])
    return output


def read_metrics(path: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def machine() -> dict:
    import platform

    return {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine()}
