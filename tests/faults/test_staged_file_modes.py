"""Files staged with mkstemp (created 0600) end with the mode the user's umask gives a new file."""
import json
import os
import stat

import numpy as np
import pytest

from mxc.runtime.metrics import MetricsLog
from mxc.runtime.token_file import write_tokens


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=["022", "077", "002"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_token_file_gets_the_mode_of_a_new_file(tmp_path, umask):
    path = tmp_path / "tokens.bin"
    write_tokens(path, [np.arange(10)], vocab_size=16, eod_id=None, tokenizer="test")
    assert _mode(path) == 0o666 & ~umask


def test_a_metrics_file_rewritten_on_resume_gets_the_mode_of_a_new_file(tmp_path, umask):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2, 3):
        log.write({"step": step, "kind": "train", "loss": 1.0})
    log.close()
    fresh = _mode(path)
    MetricsLog(path, resume_after_step=2).close()  # drops step 3 by rewriting the file
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert _mode(path) == fresh == 0o666 & ~umask
