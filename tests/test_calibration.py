"""The step-time model's constants against MaxText's published rows: the constants in
mxc.compiler.plan.calibration are what the fit gives on the saved cost terms of every row whose
MaxText setting mxc compiled (tests/data/calibration_terms.json), and each row's in-sample and
leave-one-out error is what docs/plans.md reports. Fast: no compile, the fit reads the saved terms."""

import functools

import pytest

from mxc.compiler.plan.calibration import FITTED, calibration_rows, leave_one_out, published_rows

# Each row's (in-sample, left-out) relative error of the estimated MFU, as docs/plans.md shows them;
# the published MFU on the estimates' FLOP count (calibration.published_mfu).
LEAVE_ONE_OUT = {
    "Llama 3.1 8B, v6e-256": (0.012, 0.134),
    "Llama 3.1 70B, v6e-256": (0.087, 0.128),
    "Llama 3.1 405B, 2 x v6e-256": (0.02, 0.032),
    "Mixtral 8x7B, v6e-256": (-0.086, -0.134),
    "Llama 2 70B, v5p-512": (-0.023, -0.055),
}
# What the issue asks of every row, in sample and left out.
TARGET = 0.15
# Rows known to miss the target left out (docs/plans.md, "Calibration"): none since the prior's
# pull was weakened (Mixtral read -15.007% before).
OUTSIDE_LEFT_OUT: dict[str, float] = {}


@functools.lru_cache(maxsize=None)
def _fitted():
    rows, skipped = calibration_rows()
    constants, table = leave_one_out(rows)
    return rows, skipped, constants, table


def test_the_stated_constants_are_the_fit_on_every_saved_row():
    # Changing a constant in calibration.py, or a row's terms, fails here.
    _, _, constants, _ = _fitted()
    assert constants == FITTED


def test_each_rows_error_in_sample_and_left_out():
    _, _, _, table = _fitted()
    errors = {v.name: (round(v.in_sample_error, 3), round(v.left_out_error, 3)) for v in table}
    assert errors == LEAVE_ONE_OUT


def test_published_mfu_is_on_the_estimates_count():
    # The file's printed MFU counts attention in full (MaxText's log); on mxc's count, from the
    # published tokens/s, the 8B row is 40.41%.
    rows, _, _, _ = _fitted()
    eight_b = next(r for r in rows if r.name == "Llama 3.1 8B, v6e-256")
    assert eight_b.published_mfu == pytest.approx(0.4041, abs=5e-4)


def test_every_published_row_has_compiled_terms():
    rows, skipped, _, _ = _fitted()
    assert not skipped, f"rows without a compiled program: {skipped}"
    assert {r.name for r in rows} == {r["name"] for r in published_rows()}


def test_in_sample_and_left_out_within_the_target():
    _, _, _, table = _fitted()
    for v in table:
        assert abs(v.in_sample_error) <= TARGET, v
        assert abs(v.left_out_error) <= OUTSIDE_LEFT_OUT.get(v.name, TARGET) + 5e-4, v


@pytest.mark.parametrize("name", ["matmul", "hbm", "link", "overlap"])
def test_moving_a_constant_worsens_the_fit(name):
    # The stated constants are a minimum of the fit's loss, to the grid search's resolution: 5% off
    # any of them (within its bounds) does not lower it by more than 0.1%.
    from dataclasses import replace

    from mxc.compiler.plan.calibration import BOUNDS, _loss

    rows, _, constants, _ = _fitted()
    base = _loss(rows, constants)
    low, high = BOUNDS[name]
    for factor in (0.95, 1.05):
        value = min(high, max(low, getattr(constants, name) * factor))
        if value != getattr(constants, name):
            assert _loss(rows, replace(constants, **{name: value})) > base * (1 - 1e-3)
