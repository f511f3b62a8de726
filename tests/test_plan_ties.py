"""The verified search's near-tie rule (`compare="auto"`, the default): past the first plan XLA fits,
the next candidates within search.TIE_BAND of its formula step time are compiled too, while the
attempts and the planning budget last, and their compiled programs rank them. XLA is stubbed."""

from __future__ import annotations

import pytest

from mxc.compiler.plan import search
from mxc.compiler.plan.plan import Verification
from mxc.compiler.topology import parse
from mxc.spec.load import load_model


class FakeCompiler:
    """Stands in for search._verify: every candidate fits; each compile takes `seconds` on a fake
    clock; the compiled step times come from `step_s` in the order compiled."""

    def __init__(self, monkeypatch, seconds: float, step_s: list[float]):
        self.clock, self.seconds, self.step_s, self.compiled = 0.0, seconds, step_s, []
        monkeypatch.setattr(search, "_verify", self.verify)
        monkeypatch.setattr(search, "_now", lambda: self.clock)

    def verify(self, spec, candidate, topology):
        self.clock += self.seconds
        step = self.step_s[len(self.compiled)]
        self.compiled.append(candidate)
        mfu = candidate.time.mfu * candidate.time.step_s / step
        return Verification(status="fits", time=candidate.time.model_copy(update={"step_s": step, "mfu": mfu}))


@pytest.fixture(scope="module")
def llama2_70b():
    """Llama 2 70B on v5p-512 (seq 4096, batch 1024). The verified search's order: fsdp 256,
    save_dot_with_context_except_mlp, 1 microbatch, moments on host (24.83 s by the formula);
    minimal_with_context, 4 microbatches (25.01 s); MaxText's setting, save_dot_except_mlpwi, 1
    microbatch (25.02 s, 0.8% behind the first)."""
    return load_model("llama2-70b"), parse("v5p-512")


def _plan(model, **kw):
    spec, topology = model
    return search.plan(spec, topology, seq=4096, batch=1024, **kw)


def _settings(compiled):
    return [(c.choice.remat, c.choice.microbatches) for c in compiled]


def test_near_ties_are_compiled_and_the_fastest_program_kept(monkeypatch, llama2_70b):
    xla = FakeCompiler(monkeypatch, seconds=100, step_s=[24.90, 24.69, 24.13])
    result = _plan(llama2_70b)
    # --attempts 3 ends there
    assert _settings(xla.compiled) == [("save_dot_with_context_except_mlp", 1), ("minimal_with_context", 4),
                                       ("save_dot_except_mlpwi", 1)]
    assert (result.remat, result.microbatches, result.time.step_s) == ("save_dot_except_mlpwi", 1, 24.13)
    ties = [r for r in result.reasons if r.startswith("tie compiled: ")]
    assert len(ties) == 2
    assert ties[0].startswith("tie compiled: fsdp 256; remat minimal_with_context;") and "+0.7% by the formula" in ties[0]
    assert ties[1].startswith("tie compiled: fsdp 256; remat save_dot_except_mlpwi;") and "+0.8% by the formula" in ties[1]
    lost = [c for c in result.candidates if c.lost_because.startswith("2.3% slower by the compiled programs")]
    assert [(c.mesh, c.remat, c.microbatches) for c in lost] == [({"fsdp": 256}, "minimal_with_context", 4)]
    assert lost[0].lost_because.startswith("2.3% slower by the compiled programs (24.7 s vs 24.1 s a step; both fit)")


def test_an_explicit_compare_1_stops_at_the_first_that_fits(monkeypatch, llama2_70b):
    xla = FakeCompiler(monkeypatch, seconds=100, step_s=[24.90, 24.69])
    result = _plan(llama2_70b, compare=1)
    assert len(xla.compiled) == 1 and result.time.step_s == 24.90


def test_the_planning_budget_skips_a_tie_compile(monkeypatch, llama2_70b):
    """Compiles of 250 s: after two, 500 s spent plus 250 for the next would pass the 600 s budget."""
    xla = FakeCompiler(monkeypatch, seconds=250, step_s=[24.90, 24.69, 24.13])
    result = _plan(llama2_70b)
    assert _settings(xla.compiled) == [("save_dot_with_context_except_mlp", 1), ("minimal_with_context", 4)]
    assert result.time.step_s == 24.69
    skipped = [r for r in result.reasons if r.startswith("tie compile skipped")]
    assert len(skipped) == 1 and "remat save_dot_except_mlpwi;" in skipped[0]
    assert "500 s spent" in skipped[0] and "600 s planning budget" in skipped[0]


def test_a_candidate_outside_the_band_is_not_compiled(monkeypatch):
    """llama3-tiny on v5p-8: the formula's second candidate is 12% or more behind the first."""
    xla = FakeCompiler(monkeypatch, seconds=1, step_s=[10.0, 5.0])
    result = search.plan(load_model("llama3-tiny"), parse("v5p-8"), seq=64, batch=16)
    assert len(xla.compiled) == 1 and result.time.step_s == 10.0
    assert not any(r.startswith("tie") for r in result.reasons)


def test_off_tpus_auto_keeps_the_first_that_fits(monkeypatch):
    """llama3-tiny on cpu-8 (fsdp 8): 2 microbatches is 1.1% behind 1 by the formula, but the
    compiled programs' estimate is calibrated on TPU programs only, so nothing more is compiled."""
    xla = FakeCompiler(monkeypatch, seconds=1, step_s=[10.0, 5.0])
    result = search.plan(load_model("llama3-tiny"), parse("cpu-8"), seq=256, batch=32, pins={"fsdp": 8})
    assert len(xla.compiled) == 1 and result.time.step_s == 10.0


def test_an_estimate_above_the_chips_peak_does_not_win_the_tie(monkeypatch, llama2_70b):
    """A program read as 0.82 s a step (MFU far above 1: the reader missed part of it) ranks by the
    formula's 24.83 s instead, behind MaxText's setting's 24.13 s."""
    xla = FakeCompiler(monkeypatch, seconds=100, step_s=[0.82, 24.69, 24.13])
    result = _plan(llama2_70b)
    assert len(xla.compiled) == 3
    assert (result.remat, result.microbatches, result.time.step_s) == ("save_dot_except_mlpwi", 1, 24.13)
    ranked = next(r for r in result.reasons if r.startswith("ranked by"))
    assert "above the chip's peak" in ranked
    lost = {(c.remat, c.microbatches): c.lost_because for c in result.candidates}
    assert "above the chip's peak (not read whole)" in lost[("save_dot_with_context_except_mlp", 1)]
