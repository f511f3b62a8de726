"""`mxc compile --sign KEY` checks the key before any compile work: a missing or wrong key file is
one `mxc: error:` naming the file, in seconds, with no artifact or cache entry written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def _public_key_file(folder: Path) -> Path:
    path = folder / "public.pem"
    path.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.mark.parametrize("kind", ["missing", "public key", "not a key"])
def test_a_bad_signing_key_fails_before_compiling(tmp_path, kind):
    key = {"missing": lambda: tmp_path / "absent.pem",
           "public key": lambda: _public_key_file(tmp_path),
           "not a key": lambda: (tmp_path / "junk.pem").write_text("junk") and tmp_path / "junk.pem"}[kind]()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "MXC_DEBUG")}
    env.update(MXC_CACHE_DIR=str(tmp_path / "cache"), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    output = tmp_path / "artifact"
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).with_name("mxc")), "compile", "llama3-tiny", "--topology",
                           "cpu-8", "-o", str(output), "--sign", str(key)],
                          capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.startswith("mxc: error: --sign:") and str(key) in done.stderr
    assert "Traceback" not in done.stderr
    assert not output.exists() and not (tmp_path / "cache").exists()
    assert seconds < 60  # compiling llama3-tiny's functions takes far longer on a shared host
