"""Issue 22: an artifact carries no absolute path of the build host (the repository, the venv,
the home folder) in its HLO locations or anywhere else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def test_no_file_of_an_artifact_holds_a_build_host_path(tmp_path):
    # In a child process: a cpu-8 compile sets device flags before jax is imported.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "MXC_DEBUG")}
    env.update(MXC_CACHE_DIR=str(tmp_path / "cache"), ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               XLA_FLAGS="--xla_backend_optimization_level=0")
    artifact = tmp_path / "art"
    done = subprocess.run([str(Path(sys.executable).with_name("mxc")), "compile", "llama3-tiny", "--topology",
                           "cpu-8", "--seq", "32", "--batch", "8", "-o", str(artifact)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    needles = {str(REPOSITORY), sys.prefix, str(Path(sys.prefix).resolve()), os.path.expanduser("~") + "/"}
    found = [(path.name, needle) for path in sorted(artifact.iterdir()) for needle in sorted(needles)
             if needle.encode() in path.read_bytes()]
    assert found == []
