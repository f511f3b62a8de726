"""TensorBoard event files for a run (`mxc run --tensorboard DIR`): every number of every metrics
record as a scalar, tagged by its kind (`train/loss`, `train/learning_rate`, `eval/perplexity`...)
at its step, written with tensorboardX's SummaryWriter.

A resumed run's writer purges, for TensorBoard, the steps after the checkpoint it resumed from
(the steps the killed run reported but the resumed one repeats), as the JSON-lines metrics file
drops them: the curves read as one run.
"""

from __future__ import annotations

import math
import os

# Fields of a metrics record that are not measurements.
NOT_SCALARS = ("step", "kind", "time")


class TensorBoardLog:
    def __init__(self, directory: str | os.PathLike, *, resume_after_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.directory = os.fspath(directory)
        self._writer = SummaryWriter(logdir=self.directory,
                                     purge_step=None if resume_after_step is None else resume_after_step + 1)

    def write(self, record: dict) -> None:
        kind, step = record.get("kind", "train"), record["step"]
        for name, value in record.items():
            if name in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # None (an MFU without a known peak) and text have no curve
            if math.isfinite(value):
                self._writer.add_scalar(f"{kind}/{name}", float(value), global_step=step, walltime=record.get("time"))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
