"""A JAX profiler trace of chosen steps (`mxc run --profile-steps K:N`): the trace starts before
step K is dispatched and stops once step N has finished on the devices, so it holds steps K to N
whole. jax.profiler writes DIR/plugins/profile/<run>/<host>.xplane.pb, which TensorBoard's
profile plugin and XProf open (`xprof --logdir DIR`, or `tensorboard --logdir DIR`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path


class ProfileStepsError(ValueError):
    """A --profile-steps value that names no steps."""


@dataclass(frozen=True)
class ProfileWindow:
    first: int  # the first step traced (1-based, as the metrics number steps)
    last: int
    directory: Path

    @classmethod
    def parse(cls, text: str, directory: str | Path) -> "ProfileWindow":
        """`K:N` (steps K to N, inclusive) or `K` (that step alone)."""
        parts = text.split(":")
        try:
            first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
        except ValueError:
            first = last = None
        if first is None or first < 1 or last < first:
            raise ProfileStepsError(f"--profile-steps {text!r}: expected K:N, the first and last step to trace "
                                    "(1 <= K <= N)")
        return cls(first, last, Path(directory))


class StepProfiler:
    """Starts and stops jax's trace around the window's steps; `traces` lists what was written."""

    def __init__(self, window: ProfileWindow | None):
        self.window = window
        self.active = False
        self.traces: list[Path] = []

    def before_dispatch(self, step: int) -> None:
        """Called before step `step` (1-based) is dispatched."""
        if self.window is not None and not self.active and self.window.first <= step <= self.window.last:
            import jax

            self.window.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.window.directory))
            self.active = True

    def annotation(self, step: int):
        """XProf's step marker around one step's dispatch, while tracing."""
        if not self.active:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after_dispatch(self, step: int, wait) -> bool:
        """Called once step `step` is dispatched; `wait()` blocks until it has finished. True when
        this ended the trace."""
        if not (self.active and step >= self.window.last):
            return False
        wait()
        self.stop()
        return True

    def stop(self) -> None:
        if not self.active:
            return
        import jax

        before = set(self.window.directory.rglob("*.xplane.pb"))
        jax.profiler.stop_trace()
        self.active = False
        self.traces = sorted(set(self.window.directory.rglob("*.xplane.pb")) - before)
