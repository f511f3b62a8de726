"""`mxc run` with the schedule set at run time, end to end through the command line (slow: each
compiles a tiny Llama for cpu-8 in a child process):

- a run killed with SIGKILL in the middle of its warmup and started again continues the same
  schedule: the same rates and losses as the uninterrupted run;
- a freshly compiled llama3-tiny (default compile flags: its artifact warms up over 1,000 of
  10,000 steps) lowers the loss by more than 1 nat in `mxc run --steps 60` on text of the
  repository that does not change (data/text: Pride and Prejudice, chapters 1-6; the README and
  docs grow with the project, and the drop on them moved from 1.04 to 0.99 as they did), and tells
  TensorBoard, a profile and the summary about it.
"""

import os
import signal
import subprocess
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from runtime_support import (MXC, compile_tiny, corpus_files, cpu_env, read_metrics, run_command, tokenize,
                             wait_for_step)
from test_run_observability import read_event_files, scalars

pytestmark = pytest.mark.slow
REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("run_schedule_cli")


def test_a_run_killed_mid_warmup_resumes_the_same_schedule(workdir):
    artifact = compile_tiny(workdir / "artifact")
    tokens = tokenize(corpus_files(), workdir / "tokens.bin")
    flags = ["--warmup-steps", "16", "--save-every", "4"]
    reference, killed = workdir / "whole.jsonl", workdir / "killed.jsonl"
    done = subprocess.run(run_command(artifact, tokens, workdir / "whole", steps=24, metrics=reference, extra=flags),
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    command = run_command(artifact, tokens, workdir / "killed", steps=24, metrics=killed, extra=flags)
    process = subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(process, killed, 9)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    killed_at = read_metrics(killed)[-1]["step"]
    assert killed_at < 16, "the run left its warmup before it could be killed"
    done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from step" in done.stderr and "schedule changed" not in done.stderr

    expected = [(r["step"], r["learning_rate"], r["loss"], r["grad_norm"]) for r in read_metrics(reference)]
    assert [(r["step"], r["learning_rate"], r["loss"], r["grad_norm"]) for r in read_metrics(killed)] == expected
    rates = [rate for _, rate, _, _ in expected]
    assert rates[0] == 0.0 and 0 < rates[8] < rates[15] < rates[16]  # warming up until step 16


def test_a_fresh_default_artifact_learns_in_sixty_steps_and_reports_it(workdir):
    env = cpu_env(8)
    artifact = workdir / "default"
    done = subprocess.run([MXC, "compile", "llama3-tiny", "--topology", "cpu-8", "--seq", "128", "--batch", "16",
                           "-o", str(artifact)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    tokens = tokenize([str(REPOSITORY / "data" / "text" / "pride_and_prejudice_ch1-6.txt")], workdir / "text.bin")
    metrics, board = workdir / "default.jsonl", workdir / "tb"
    done = subprocess.run(run_command(artifact, tokens, workdir / "default_ckpt", steps=60, metrics=metrics,
                                      extra=["--eval-data", str(tokens), "--eval-every", "30", "--eval-batches", "2",
                                             "--tensorboard", str(board), "--profile-steps", "11:12"]),
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [r["loss"] for r in read_metrics(metrics)]
    assert len(losses) == 60 and losses[0] - losses[-1] > 1.0, losses
    err = done.stderr
    assert "learning rate: cosine, peak 0.0003, warmup 6, floor 3e-05 at step 60" in err
    assert "eval at step 60: loss " in err and ", perplexity " in err
    assert "tokens seen 122,880 in 60 steps" in err and "mean " in err
    assert "MFU " in err and "(mxc's nominal CPU peak: indicative only)" in err
    assert "eval loss: final " in err and "best " in err
    found = scalars(read_event_files(board))
    assert sorted(found["train/loss"]) == list(range(1, 61)) and sorted(found["eval/perplexity"]) == [30, 60]
    traces = list((board / "plugins" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and f"profile of steps 11-12: {traces[0]}" in err
