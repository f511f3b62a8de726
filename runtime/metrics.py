"""What a run reports: metrics as JSON lines, model FLOPs utilisation, and a progress display.

A metrics file holds one JSON object per line, each with `step` (the number of updates applied
when it was measured) and `kind` ("train" or "eval"). Resuming a run rewrites the file without
the lines after the checkpoint it resumed from, so the file always reads as one run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from mxc.runtime.file_modes import give_new_file_mode


def model_flops_utilisation(flops_per_step: float | None, step_seconds: float,
                            peak_flops: float | None) -> float | None:
    """MFU (PaLM, Chowdhery et al. 2022, app. B): the model's FLOPs per step over what the
    devices could do in that time. `peak_flops` is the whole mesh's; None where unknown."""
    if not flops_per_step or not peak_flops or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / peak_flops


def json_number(value):
    """Floats as JSON can hold them: NaN and infinities as strings, which json.dumps would
    otherwise write as bare NaN, a token JSON does not have."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends metric records to a JSON-lines file (or nowhere, when path is None)."""

    def __init__(self, path: str | os.PathLike | None, *, resume_after_step: int | None = None):
        self.path = None if path is None else Path(path)
        self._file = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is None:
            self._file = open(self.path, "w", encoding="utf-8")
        else:
            self._drop_after(resume_after_step)
            self._file = open(self.path, "a", encoding="utf-8")

    def _drop_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash this run resumes from
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        give_new_file_mode(handle)
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
        os.replace(temp, self.path)

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({k: json_number(v) for k, v in record.items()}) + "\n")
        self._file.flush()  # a killed run keeps every line it reported

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ProgressDisplay:
    """A rich progress bar on a terminal; on anything else (a log file, a test), one plain line
    every `log_every` steps, since a redrawn bar there is noise."""

    def __init__(self, total_steps: int, first_step: int, *, enabled: bool = True, log_every: int = 10):
        self.total_steps, self.log_every, self.enabled = total_steps, log_every, enabled
        self._progress = None
        if not enabled:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                      console=console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=first_step, status="")
            self._progress.start()

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        status = (f"loss {record['loss']:.4f}  lr {record['learning_rate']:.2e}  "
                  f"{record['tokens_per_second']:,.0f} tok/s")
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], status=status)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total_steps:
            print(f"step {record['step']}/{self.total_steps}  {status}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
