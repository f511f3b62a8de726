"""The learning-rate schedule of a run, computed on the host every step and fed to the compiled
train step as its `schedule` argument ({"learning_rate": float32 scalar}).

Four shapes, all with a linear warmup from 0 to the peak over `warmup_steps` (the rate of the
update at step s, counted from 0, is peak·s/warmup_steps there):

    cosine    peak → floor by a half cosine, reaching the floor at `decay_steps`
    linear    peak → floor linearly, reaching the floor at `decay_steps`
    constant  the peak after the warmup (decay_steps and the floor do not apply)
    wsd       warmup-stable-decay (MaxText's `wsd`, MiniCPM): the peak until the last
              `decay_fraction` of `decay_steps`, then linearly down to the floor at `decay_steps`

`decay_steps` counts from step 0, warmup included (as optax's warmup_cosine_decay_schedule and
MaxText's `learning_rate_schedule_steps` do); past it the rate stays at the floor,
peak·min_ratio. Plain Python (numpy only for the float32 it hands the train step): the runtime
needs no compiler, and nothing here is traced.

A run's schedule is stored in each checkpoint's meta (`to_json`) so a resumed run continues it;
flags given on the resuming command line replace the stored values they name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

KINDS = ("cosine", "linear", "constant", "wsd")

# The artifact's defaults when its manifest records no optimizer (OptimizerConfig's own defaults).
DEFAULT_PEAK, DEFAULT_MIN_RATIO, DEFAULT_WARMUP_FRACTION = 3e-4, 0.1, 0.1
# MaxText's wsd_decay_steps_fraction default: the last tenth decays.
DEFAULT_DECAY_FRACTION = 0.1


class ScheduleError(ValueError):
    """Schedule settings that do not describe a schedule; the message names the flag."""


@dataclass(frozen=True)
class Schedule:
    kind: str
    peak: float  # the rate at the end of warmup
    warmup_steps: int
    decay_steps: int  # the step at which the rate reaches the floor (warmup included)
    min_ratio: float = DEFAULT_MIN_RATIO  # the floor, as a fraction of the peak
    decay_fraction: float = DEFAULT_DECAY_FRACTION  # wsd only: the share of decay_steps that decays

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"--schedule {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not (math.isfinite(self.peak) and self.peak > 0):
            raise ScheduleError(f"--learning-rate {self.peak}: expected a positive number")
        if self.warmup_steps < 0:
            raise ScheduleError(f"--warmup-steps {self.warmup_steps}: expected 0 or more")
        if self.decay_steps < 1:
            raise ScheduleError(f"--decay-steps {self.decay_steps}: expected at least 1")
        if self.kind != "constant" and self.decay_steps < self.warmup_steps:
            raise ScheduleError(f"--decay-steps {self.decay_steps} ends before --warmup-steps "
                                f"{self.warmup_steps} does: the decay counts from step 0, warmup included")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ScheduleError(f"--min-lr-ratio {self.min_ratio}: expected a fraction from 0 to 1")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ScheduleError(f"--decay-fraction {self.decay_fraction}: expected a fraction above 0, at most 1")

    @property
    def floor(self) -> float:
        return self.peak * self.min_ratio

    @property
    def wsd_decay_start(self) -> int:
        """wsd: the step where the stable phase ends and the decay begins."""
        decaying = min(round(self.decay_fraction * self.decay_steps), self.decay_steps - self.warmup_steps)
        return self.decay_steps - decaying

    def rate(self, step: int) -> float:
        """The learning rate of the update applied at `step` (0 for the first update)."""
        if step < self.warmup_steps:
            return self.peak * step / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        start = self.wsd_decay_start if self.kind == "wsd" else self.warmup_steps
        if step < start:
            return self.peak
        length = self.decay_steps - start
        progress = 1.0 if length <= 0 else min((step - start) / length, 1.0)
        if self.kind == "cosine":
            return self.floor + (self.peak - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak + (self.floor - self.peak) * progress

    def inputs(self, step: int) -> dict:
        """The train step's `schedule` argument for the update at `step`."""
        return {"learning_rate": np.float32(self.rate(step))}

    def describe(self) -> str:
        text = f"{self.kind}, peak {self.peak:g}, warmup {self.warmup_steps}"
        if self.kind == "constant":
            return text
        if self.kind == "wsd":
            text += f", decay from step {self.wsd_decay_start}"
        return text + f", floor {self.floor:g} at step {self.decay_steps}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Schedule":
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in fields})

    def changes_from(self, before: "Schedule") -> list[str]:
        """`name old -> new` for every setting that differs from `before`."""
        return [f"{field.name} {getattr(before, field.name)} -> {getattr(self, field.name)}"
                for field in dataclasses.fields(self) if getattr(before, field.name) != getattr(self, field.name)]


@dataclass(frozen=True)
class ScheduleRequest:
    """What `mxc run` was asked for: the schedule flags (None where not given) and what they
    default to: the artifact's optimizer settings (manifest run.optimizer) and `--steps`."""

    steps: int
    artifact_optimizer: dict = dataclasses.field(default_factory=dict)
    kind: str | None = None
    peak: float | None = None
    warmup_steps: int | None = None
    decay_steps: int | None = None
    min_ratio: float | None = None
    decay_fraction: float | None = None

    def _given(self) -> dict:
        names = ("kind", "peak", "warmup_steps", "decay_steps", "min_ratio", "decay_fraction")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def default_warmup(self) -> int:
        """The artifact's warmup (its own default: a tenth of its total steps), but at most a
        tenth of this run, so that a short run spends most of its steps at the peak."""
        optimizer = self.artifact_optimizer
        artifact = optimizer.get("warmup_steps")
        if artifact is None:
            artifact = int(optimizer.get("total_steps", self.steps) * DEFAULT_WARMUP_FRACTION)
        return min(int(artifact), int(self.steps * DEFAULT_WARMUP_FRACTION))

    def _checked(self, schedule: Schedule) -> Schedule:
        """`schedule`, once every flag given applies to its kind (none is silently ignored)."""
        given = self._given()
        if "decay_fraction" in given and schedule.kind != "wsd":
            raise ScheduleError(f"--decay-fraction applies to --schedule wsd only, not {schedule.kind}")
        if schedule.kind == "constant":
            for name, flag in (("decay_steps", "--decay-steps"), ("min_ratio", "--min-lr-ratio")):
                if name in given:
                    raise ScheduleError(f"{flag} does not apply to --schedule constant (the rate stays at the peak)")
        return schedule

    def fresh(self) -> Schedule:
        """The schedule of a run that starts at step 0."""
        optimizer = self.artifact_optimizer
        given = self._given()
        warmup = given.get("warmup_steps", self.default_warmup())
        settings = {"kind": "cosine", "peak": float(optimizer.get("learning_rate", DEFAULT_PEAK)),
                    "warmup_steps": warmup, "decay_steps": max(self.steps, warmup, 1),
                    "min_ratio": float(optimizer.get("min_lr_ratio", DEFAULT_MIN_RATIO)),
                    "decay_fraction": DEFAULT_DECAY_FRACTION}
        return self._checked(Schedule(**{**settings, **given}))

    def resumed(self, stored: dict | None) -> tuple[Schedule, list[str]]:
        """The schedule of a run resumed from a checkpoint that stored `stored` (None: it stored
        none), and what the flags changed in it."""
        if not stored:
            return self.fresh(), []
        before = Schedule.from_json(stored)
        after = self._checked(dataclasses.replace(before, **self._given()))
        return after, after.changes_from(before)
