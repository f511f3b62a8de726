"""How many candidates the verified search compiles before giving up: `--attempts N` exactly N;
by default search.MIN_ATTEMPTS, and past them more while none has fit and the planning budget
allows (DeepSeek V3 671B on v5p-512 fits at the fourth compile). XLA is stubbed."""

from __future__ import annotations

from mxc.compiler.plan import search
from mxc.compiler.plan.plan import Verification
from mxc.compiler.topology import parse
from mxc.spec.load import load_model


class RefusingCompiler:
    """Stands in for search._verify: the first `refusals` compiles are rejected (not for memory,
    so no refusal condemns another candidate), the next fit; each takes `seconds` on a fake clock."""

    def __init__(self, monkeypatch, seconds: float, refusals: int):
        self.clock, self.seconds, self.refusals, self.compiled = 0.0, seconds, refusals, []
        monkeypatch.setattr(search, "_verify", self.verify)
        monkeypatch.setattr(search, "_now", lambda: self.clock)

    def verify(self, spec, candidate, topology):
        self.clock += self.seconds
        self.compiled.append(candidate)
        if len(self.compiled) <= self.refusals:
            return Verification(status="rejected", reason="INTERNAL: a compiler error")
        return Verification(status="fits")


def _plan(**kw):
    return search.plan(load_model("llama3-tiny"), parse("v5p-8"), seq=64, batch=16, **kw)


def test_by_default_the_search_goes_on_past_three_refusals_until_one_fits(monkeypatch):
    xla = RefusingCompiler(monkeypatch, seconds=60, refusals=4)
    result = _plan()
    assert len(xla.compiled) == 5
    assert result.xla.status == "fits"


def test_an_explicit_attempts_is_exact(monkeypatch):
    xla = RefusingCompiler(monkeypatch, seconds=60, refusals=4)
    result = _plan(attempts=3)
    assert len(xla.compiled) == 3
    assert result.xla.status == "rejected"


def test_past_the_minimum_the_planning_budget_stops_the_search(monkeypatch):
    """Compiles of 200 s: three take 600 s, and a fourth would pass the 600 s budget."""
    xla = RefusingCompiler(monkeypatch, seconds=200, refusals=4)
    result = _plan()
    assert len(xla.compiled) == search.MIN_ATTEMPTS
    assert result.xla.status == "rejected"
