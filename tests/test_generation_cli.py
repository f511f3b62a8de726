"""`mxc tokenize` and `mxc generate` as a user meets them (issue 18): file modes, one set of generate
flags for a spec and an artifact, help for both forms, and clear errors for flags and prompt files
that do not apply."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

from mxc.runtime.tokenize import byte_tokenizer, tokenize_files

MXC = [sys.executable, "-m", "mxc"]


def _mxc(*arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([*MXC, *arguments], env=env, capture_output=True, text=True, timeout=300)


def test_token_files_follow_the_umask(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world")
    previous = os.umask(0o022)
    try:
        tokenize_files([str(text)], str(tmp_path / "t.bin"), tokenizer=byte_tokenizer())
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "t.bin").stat().st_mode) == 0o644
