"""Two processes (4 CPU devices each, jax.distributed over 127.0.0.1), one of them killed with
SIGKILL mid-run: the other stops within a bounded time, and two processes started again resume
from the last checkpoint and end bitwise equal (losses, gradient norms and parameters) to an
uninterrupted two-process run. Killing process 0 takes the coordinator and the checkpoint lock
holder with it; killing process 1 leaves both alive.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # runtime_support lives in tests/
from runtime_support import (PYTHON, compile_tiny, corpus_files, cpu_env, free_port, read_metrics,
                             restore_on_one_device, tokenize, wait_for_step)

STEPS, SAVE_EVERY, KILL_AFTER = 24, 6, 14
# The survivor learns of its peer's death from a failed collective or, at the latest, from the
# coordination service's missed heartbeats; this bounds how long it may take to exit.
HEARTBEAT_S, SURVIVOR_EXIT_S = 10, 60

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("multiprocess_kill_resume")


@pytest.fixture(scope="module")
def artifact(workdir):
    return compile_tiny(workdir / "artifact")


@pytest.fixture(scope="module")
def tokens(workdir):
    return tokenize(corpus_files(), workdir / "tokens.bin")


@pytest.fixture(scope="module")
def reference(workdir, artifact, tokens):
    """The uninterrupted two-process run: (metrics of process 0, checkpoint folder)."""
    processes = _two_process_run(artifact, tokens, workdir, "reference")
    errors = _wait_all(processes, timeout=600)
    assert [p.returncode for p in processes] == [0, 0], errors
    return workdir / "reference_0.jsonl", workdir / "reference_ckpt"


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_process_stops_its_peer_and_the_run_resumes_bitwise(workdir, artifact, tokens, reference, killed):
    name = f"killed{killed}"
    processes = _two_process_run(artifact, tokens, workdir, name)
    survivor = processes[1 - killed]
    try:
        wait_for_step(processes[0], workdir / f"{name}_0.jsonl", KILL_AFTER)
        processes[killed].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        processes[killed].wait(timeout=60)
        try:
            _, survivor_errors = survivor.communicate(timeout=SURVIVOR_EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {1 - killed} still ran {SURVIVOR_EXIT_S} s after process {killed} was killed")
        survivor_exit_s = time.monotonic() - killed_at
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    print(f"process {1 - killed} exited {survivor.returncode} {survivor_exit_s:.1f} s after process {killed} "
          f"was killed; its stderr ends:\n{survivor_errors[-2000:]}")
    assert survivor.returncode != 0, "the survivor reported success for a run that lost a process"
    stopped_at = read_metrics(workdir / f"{name}_0.jsonl")[-1]["step"]
    assert stopped_at < STEPS, "the run finished before a process was killed"
    saved = sorted(int(p.name) for p in (workdir / f"{name}_ckpt").iterdir() if p.name.isdigit())
    assert saved and saved[-1] >= SAVE_EVERY, saved
    print(f"stopped at step {stopped_at}, checkpoints {saved}")


    resumed = _two_process_run(artifact, tokens, workdir, name)
    errors = _wait_all(resumed, timeout=600)
    assert [p.returncode for p in resumed] == [0, 0], errors
    # From the newest checkpoint the killed run left, not from scratch (which would also match).
    assert f"resumed from step {saved[-1]} " in errors[0], errors[0][-4000:]

    ref_metrics, ref_ckpt = reference
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(ref_metrics)]
    assert [r[0] for r in expected] == list(range(1, STEPS + 1))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(workdir / f"{name}_0.jsonl")] == expected
    reference_params = dict(_flatten(restore_on_one_device(ref_ckpt, STEPS)))
    resumed_params = dict(_flatten(restore_on_one_device(workdir / f"{name}_ckpt", STEPS)))
    assert reference_params.keys() == resumed_params.keys()
    for key, value in reference_params.items():
        assert np.array_equal(value, resumed_params[key]), key


def _two_process_run(artifact, tokens, workdir, name):
    """Process 0 and 1 of one run, 4 of the artifact's 8 CPU devices each; process 0 writes the
    metrics and the checkpoints."""
    port = free_port()
    processes = []
    for process_id in range(2):
        command = [PYTHON, "-m", "mxc.runtime", "run", str(artifact), "--data", str(tokens),
                   "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--ckpt-dir", str(workdir / f"{name}_ckpt"),
                   "--metrics", str(workdir / f"{name}_{process_id}.jsonl"), "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(process_id), "--heartbeat-timeout", str(HEARTBEAT_S)]
        processes.append(subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
    return processes


def _wait_all(processes, timeout):
    """The stderr of each process once all have exited; kills any still running at the end."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}/{index}")
    else:
        yield prefix, np.asarray(tree)
