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

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchModel:
    """A Llama-shaped bench model, written both as an .mspec and as a transformers LlamaConfig so
    that mxc and PyTorch run the same network."""

    name: str
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    tied: bool
    rope_theta: float = 500000.0

    def mspec(self) -> str:
        return f"""
model {self.name} {{
  vocab = {self.vocab}
  d_model = {self.d_model}
  max_seq = 2048
  embedding = embedding(tied = {str(self.tied).lower()})
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = float32
  block x {self.layers} {{
    attention = gqa(heads = {self.heads}, kv_heads = {self.kv_heads}, head_dim = {self.head_dim}, rope = rope(theta = {self.rope_theta:g}))
    mlp = glu(hidden = {self.hidden}, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }}
}}
"""

    def hf_config(self) -> dict:
        """transformers.LlamaConfig keyword arguments for the same network."""
        return {"vocab_size": self.vocab, "hidden_size": self.d_model, "intermediate_size": self.hidden,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "rope_theta": self.rope_theta,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": self.tied,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

    def parameters(self) -> int:
        attention = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.d_model * self.hidden + 2 * self.d_model
        return self.vocab * self.d_model * (1 if self.tied else 2) + self.layers * layer + self.d_model


# The models the runtime benches run, by preset name. "llama-20m" is the 20.58M-parameter model
# measured against PyTorch (untied head, four layers); "smollm2-135m" has SmolLM2-135M's shape
# (HuggingFaceTB/SmolLM2-135M's config.json), with random weights.
MODELS = {
    "llama-20m": BenchModel("bench-llama-20m", vocab=32000, d_model=256, layers=4, heads=4, kv_heads=4,
                            head_dim=64, hidden=1024, tied=False),
    "llama-20m-v1024": BenchModel("bench-llama-20m-v1024", vocab=1024, d_model=256, layers=4, heads=4, kv_heads=4,
                                  head_dim=64, hidden=1024, tied=False),
    "llama-100m": BenchModel("bench-llama-100m", vocab=32000, d_model=768, layers=12, heads=12, kv_heads=4,
                             head_dim=64, hidden=2048, tied=True),
    "smollm2-135m": BenchModel("bench-smollm2-135m", vocab=49152, d_model=576, layers=30, heads=9, kv_heads=3,
                               head_dim=64, hidden=1536, tied=True, rope_theta=100000.0),
}

# ~100M parameters: GPT-2-small-sized Llama (d_model 768), tied 32k embedding.
LLAMA_100M = MODELS["llama-100m"].mspec()


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
