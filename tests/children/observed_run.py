"""A 6-step run of the loop with evaluation every 3 steps, TensorBoard scalars and a profile of
steps 2-3, on a toy model trained by the lowering's optimizer (tests/scheduled_bigram.py).

    PYTHONPATH=tests python observed_run.py DIRECTORY

Writes tokens.bin, metrics.jsonl, tb/, profile/ and ckpt/ in DIRECTORY; the console lines go to
stderr as `mxc run` prints them; prints one JSON object: the run's totals and its summary lines.
In a process of its own, kept to the CPU before jax starts: jax's profiler crashes in a process
that has initialised libtpu on a host without a TPU."""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

from scheduled_bigram import ARTIFACT_OPTIMIZER, VOCAB, scheduled_bigram  # noqa: E402

from mxc.runtime.checkpoint import Checkpoints  # noqa: E402
from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun  # noqa: E402
from mxc.runtime.profiling import ProfileWindow  # noqa: E402
from mxc.runtime.schedule import ScheduleRequest  # noqa: E402
from mxc.runtime.token_file import open_tokens, write_tokens  # noqa: E402

STEPS = 6


def main(directory: Path) -> None:
    write_tokens(directory / "tokens.bin", [np.arange(2000) % (VOCAB - 1)], vocab_size=VOCAB, eod_id=VOCAB - 1,
                 tokenizer="test")
    tokens = open_tokens(directory / "tokens.bin")
    run = TrainingRun(scheduled_bigram(flops_per_step=1e6, peak_flops=1e9), tokens, Checkpoints(directory / "ckpt"),
                      LoopConfig(steps=STEPS, eval_every=3, log_every=100), metrics_path=directory / "metrics.jsonl",
                      eval_data=tokens, schedule=ScheduleRequest(steps=STEPS, artifact_optimizer=ARTIFACT_OPTIMIZER),
                      tensorboard_dir=directory / "tb", profile=ProfileWindow(2, 3, directory / "profile"))
    try:
        with StopSignal(multi_process=False) as stop:
            summary = run.run(stop)
    finally:
        run.close()
    totals = summary.totals
    print(json.dumps({"steps": totals.steps, "tokens": totals.tokens, "train_seconds": totals.train_seconds,
                      "wall_seconds": summary.wall_seconds, "lines": totals.summary_lines(summary.wall_seconds)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
