"""The step-time model's constants, in one place, and how they are fitted.

The model (mxc.compiler.plan.cost) charges each kernel of the compiled program the longer of its
FLOPs at a fraction of the chip's peak and its bytes at a fraction of its HBM bandwidth, each
collective its ring or torus time at a fraction of the links' bandwidth, hides asynchronous
collectives and host copies behind a fraction of the compute, and stretches the step by the
pipeline bubble. The fractions below were fitted on MaxText's published pre-training results
(tests/data/published_mfu.json): `fit` minimises the squared log error of the estimated MFU over
the rows; `leave_one_out` refits without each row in turn and reports that row's error, the
honest measure of how the model holds on results it was not fitted on (docs/plans.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Constants:
    """Achieved fractions of the chip's datasheet figures."""

    matmul: float  # of peak bf16 FLOP/s, in compute-bound kernels
    hbm: float  # of HBM bandwidth, in memory-bound kernels
    link: float  # of ICI/DCN bandwidth, in collectives
    overlap: float  # of the busy time that asynchronous collectives and host copies can hide behind

    def to_json(self) -> dict:
        return asdict(self)


# Fitted by bench/plan_recipes.py --fit on tests/data/published_mfu.json (docs/plans.md, "Calibration").
FITTED = Constants(matmul=0.8192, hbm=0.6368, link=1.0, overlap=0.1154)
# Where every fit starts, so that a fit is a function of its rows alone.
START = Constants(matmul=0.6, hbm=0.6, link=0.6, overlap=0.6)
BOUNDS = {"matmul": (0.3, 1.0), "hbm": (0.3, 1.0), "link": (0.1, 1.0), "overlap": (0.05, 1.0)}
FREE = ("matmul", "hbm", "link", "overlap")  # the constants a fit moves


@dataclass(frozen=True)
class Row:
    """A published result and what mxc compiled for its setting: `estimate(constants)` is the
    estimated MFU."""

    name: str
    published_mfu: float
    estimate: Callable[[Constants], float]


# A weak pull towards START (squared log distance, this weight): with fewer rows than constants
# the fit is otherwise not unique. Weak enough that the rows, not START, choose between fits
# that differ in how much they hide (docs/plans.md, "Calibration": at 0.01 it held the overlap
# at START's 0.6 against rows that fit better near 0.12).
PRIOR = 0.001


def _loss(rows: Sequence[Row], constants: Constants) -> float:
    misfit = sum(math.log(row.estimate(constants) / row.published_mfu) ** 2 for row in rows)
    prior = sum(math.log(getattr(constants, name) / getattr(START, name)) ** 2 for name in FREE)
    return misfit + PRIOR * prior


def fit(rows: Sequence[Row], start: Constants = START, free: Sequence[str] = FREE, rounds: int = 12) -> Constants:
    """Constants that minimise the squared log error of the estimated MFU over `rows` (with the
    weak pull towards START): a coordinate search over a grid that narrows each round
    (deterministic, no dependencies)."""
    best = start
    width = {name: (BOUNDS[name][1] - BOUNDS[name][0]) / 2 for name in free}
    for _ in range(rounds):
        for name in free:
            low, high = BOUNDS[name]
            centre = getattr(best, name)
            grid = [min(high, max(low, centre + width[name] * (k / 10 - 1))) for k in range(21)]
            best = min((replace(best, **{name: value}) for value in grid), key=lambda c: _loss(rows, c))
            width[name] /= 2  # halving (not quartering): the constants trade off, each step must
            # leave room for the others to move next round
    return replace(best, **{name: round(getattr(best, name), 4) for name in free})


@dataclass(frozen=True)
class Validation:
    name: str
    published_mfu: float
    in_sample_mfu: float  # estimated with the constants fitted on every row
    left_out_mfu: float  # estimated with the constants fitted on the other rows only

    @property
    def in_sample_error(self) -> float:
        return self.in_sample_mfu / self.published_mfu - 1

    @property
    def left_out_error(self) -> float:
        return self.left_out_mfu / self.published_mfu - 1


def leave_one_out(rows: Sequence[Row], start: Constants = START,
                  free: Sequence[str] = FREE) -> tuple[Constants, list[Validation]]:
    """(constants fitted on all rows, each row's in-sample and left-out estimate)."""
    every = fit(rows, start, free)
    out = []
    for i, row in enumerate(rows):
        others = fit([r for j, r in enumerate(rows) if j != i], start, free)
        out.append(Validation(row.name, row.published_mfu, row.estimate(every), row.estimate(others)))
    return every, out


# ---------------------------------------------------------------- the published rows

# MaxText's published results and each recipe's tuning parameters (a copy of the project's
# reference file; tests/data/README.md says where it comes from), and the cost terms of each
# recipe's setting as mxc compiled it (bench/plan_recipes.py writes them).
DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def published_rows(path: Path | None = None) -> list[dict]:
    return json.loads((path or DATA / "published_mfu.json").read_text())["rows"]


def calibration_rows(terms_path: Path | None = None,
                     rows_path: Path | None = None) -> tuple[list[Row], list[tuple[str, str]]]:
    """(rows with a compiled program to fit on, (name, why) of the rows without one). `rows_path`
    and `terms_path` name another pair of files: the held-out rows (published_mfu_heldout.json,
    calibration_terms_heldout.json), checked at FITTED, never fitted on."""
    from mxc.compiler.plan.cost import ProgramTerms, program_mfu

    saved = json.loads((terms_path or DATA / "calibration_terms.json").read_text())
    rows, skipped = [], []
    for row in published_rows(rows_path):
        entry = saved.get(row["name"])
        if entry is None:
            skipped.append((row["name"], "MaxText's setting was not compiled"))
            continue
        terms = ProgramTerms.from_json(entry["terms"])
        rows.append(Row(row["name"], published_mfu(row, terms), lambda c, t=terms: program_mfu(t, c)))
    return rows, skipped


def published_mfu(row: dict, terms) -> float:
    """A published result's MFU on the FLOP count the estimates use (MaxText's training count as
    mxc makes it, causal attention at half): its tokens/s per chip times the program's model FLOPs
    per token, over the chip's peak. The fitted file's printed MFUs count attention in full (Llama
    3.1 8B on v6e-256: 45.46% printed, 40.41% on this count; docs/plans.md, "Calibration")."""
    flops_per_token = terms.model_flops / terms.tokens
    return row["published_tokens_per_s_per_device"] * flops_per_token / terms.peak_flops
