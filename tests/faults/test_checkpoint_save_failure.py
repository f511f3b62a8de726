"""A save that fails in the background (disk full, file too large) stops the run at the next step
boundary with one error naming the step and the folder; the steps saved before stay intact.

Writes are made to fail for real, without root: the child process that trains lowers its
RLIMIT_FSIZE once its first checkpoint is on disk and ignores SIGXFSZ, so every later write past
the limit fails with EFBIG, as on a full disk."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from bigram_run import LLAMA, bigram

from mxc.runtime.checkpoint import Checkpoints

SAVE_EVERY = 2

def test_a_failed_background_save_stops_the_run_and_keeps_the_older_step(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    program = Path(__file__).parents[1] / "children" / "train_until_a_save_fails.py"
    child = subprocess.run([sys.executable, program, directory, tmp_path / "t.bin", str(SAVE_EVERY)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 3, child.stderr[-3000:]
    line = child.stdout.strip()
    stopped_at = int(line.split()[3].rstrip(":"))
    assert f": saving step 4 to {directory} failed: " in line, line
    assert "File too large" in line or "EFBIG" in line or "errno 27" in line.lower(), line
    assert stopped_at <= 4 + SAVE_EVERY  # within one save interval of the failed save
    checkpoints = Checkpoints(directory, keep=None)
    try:
        assert checkpoints.latest_step() == 2
        abstract = bigram(LLAMA).abstract_state
        params, optimizer, meta = checkpoints.restore(2, params_target=abstract["params"], optimizer_target={
            "step": abstract["step"], "opt_state": abstract["opt_state"]})  # checksums checked too
        assert meta["step"] == 2 and int(np.asarray(optimizer["step"])) == 2
    finally:
        checkpoints.close()
