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


def perplexity(loss: float) -> float:
    """exp of a mean per-token cross-entropy (nats); inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class RunTotals:
    """What the end-of-run summary reports: the steps this invocation trained (tokens seen, the
    seconds spent in train steps) and its evaluations."""

    def __init__(self, tokens_per_step: int, flops_per_step: float | None, peak_flops: float | None):
        self.tokens_per_step, self.flops_per_step, self.peak_flops = tokens_per_step, flops_per_step, peak_flops
        self.steps = 0
        self.train_seconds = 0.0
        self.eval_losses: list[tuple[int, float]] = []  # (step, loss)

    def add_train(self, record: dict) -> None:
        self.steps += 1
        self.train_seconds += record["step_seconds"]

    def add_eval(self, record: dict) -> None:
        self.eval_losses.append((record["step"], record["loss"]))

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    def tokens_per_second(self) -> float | None:
        return self.tokens / self.train_seconds if self.train_seconds > 0 else None

    def mfu(self) -> float | None:
        if not self.flops_per_step:
            return None
        return model_flops_utilisation(self.flops_per_step * self.steps, self.train_seconds, self.peak_flops)

    def summary_lines(self, wall_seconds: float, peak_note: str = "") -> list[str]:
        """The summary as console lines. `peak_note` says where the peak comes from when it is
        only nominal (a CPU), so that the MFU is read as indicative."""
        rate = self.tokens_per_second()
        lines = [f"tokens seen {self.tokens:,} in {self.steps} steps; wall time {wall_seconds:.1f} s "
                 f"({self.train_seconds:.1f} s in train steps); mean "
                 + (f"{rate:,.0f} tokens/s" if rate is not None else "tokens/s unknown")]
        mfu = self.mfu()
        if mfu is not None:
            lines.append(f"MFU {100 * mfu:.2f}% of a peak of {self.peak_flops:.3g} FLOP/s{peak_note}")
        else:
            lines.append("MFU unknown: the artifact records no FLOP count or no peak for its devices")
        if self.eval_losses:
            final_step, final = self.eval_losses[-1]
            best_step, best = min(self.eval_losses, key=lambda entry: entry[1])
            lines.append(f"eval loss: final {final:.4f} (step {final_step}, perplexity {perplexity(final):.2f}), "
                         f"best {best:.4f} (step {best_step})")
        return lines
