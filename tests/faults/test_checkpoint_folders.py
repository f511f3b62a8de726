"""The checkpoint folder after runs that end badly: a run that fails before its first save leaves
no folder it created (a folder the user had stays), and a run killed with -9 right after a save
leaves a commit marker naming its absolute path only until the folder is opened again."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bigram_run import LLAMA, QWEN, bigram, token_file, train

from mxc.runtime.checkpoint import COMMIT_MARKER, COMMIT_TEXT, Checkpoints, SpecMismatchError
from mxc.runtime.data import DataError
from mxc.runtime.loop import LoopConfig, TrainingRun
from mxc.runtime.token_file import open_tokens, write_tokens


@pytest.fixture
def too_short(tmp_path):
    path = tmp_path / "short.bin"
    write_tokens(path, [np.arange(4)], vocab_size=32, eod_id=31, tokenizer="test")
    return open_tokens(path)


def test_a_run_failing_before_its_first_save_removes_the_folders_it_created(tmp_path, too_short):
    with pytest.raises(DataError):
        TrainingRun(bigram(LLAMA), too_short, Checkpoints(tmp_path / "runs" / "new"), LoopConfig(steps=2, progress=False))
    assert not (tmp_path / "runs").exists()


def test_a_folder_the_user_had_is_kept(tmp_path, too_short):
    (tmp_path / "mine").mkdir()
    with pytest.raises(DataError):
        TrainingRun(bigram(LLAMA), too_short, Checkpoints(tmp_path / "mine"), LoopConfig(steps=2, progress=False))
    assert (tmp_path / "mine").is_dir()


def test_a_refused_resume_keeps_the_checkpoint_folder(tmp_path):
    tokens = token_file(tmp_path / "t.bin")
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    with pytest.raises(SpecMismatchError):
        TrainingRun(bigram(QWEN), tokens, Checkpoints(tmp_path / "ckpt"), LoopConfig(steps=4, progress=False))
    assert (tmp_path / "ckpt" / "2").is_dir()


def test_a_marker_left_with_a_path_by_a_run_killed_with_9_is_scrubbed_when_the_folder_is_opened(tmp_path):
    directory = tmp_path / "ckpt"
    program = Path(__file__).parents[1] / "children" / "killed_after_save.py"
    child = subprocess.run([sys.executable, program, directory], capture_output=True,
                           text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    markers = list(directory.glob("*/**/" + COMMIT_MARKER))
    assert any(str(tmp_path) in marker.read_text() for marker in markers)  # what the killed run left
    checkpoints = Checkpoints(directory)
    try:
        assert [marker for marker in markers if marker.read_text() != COMMIT_TEXT] == []
    finally:
        checkpoints.close()
