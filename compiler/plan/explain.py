"""Why a plan won: for each knob (mesh, remat, microbatches) the best plan that differs in it and
what it lost by, and the next candidates with why each lost."""

from __future__ import annotations

from mxc.compiler.commands.units import duration
from mxc.compiler.plan import memory
from mxc.compiler.plan.candidates import Scored, fits, gib, mesh_text, rank, uses_memory_lever
from mxc.compiler.plan.plan import MESH_AXES, Candidate, Verification
from mxc.compiler.plan.stages import stage_reasons

CANDIDATES_SHOWN = 6


class Verdicts:
    """What the search knows when it explains: XLA's verdicts so far, the HBM, and the memory it
    kept as margin where XLA could not judge (None where it could)."""

    def __init__(self, verdicts: dict, hbm: int, margin: float | None, passed: dict | None = None):
        self.verdicts, self.hbm, self.margin = verdicts, hbm, margin
        self.passed = passed or {}  # candidates a refusal condemned, and why (search._to_compile)

    def why_lost(self, item: Scored, chosen: Scored) -> str:
        verdict: Verification | None = self.verdicts.get(item.choice)
        if verdict is not None and verdict.status in ("rejected", "over_hbm"):
            return verdict.reason
        ours = self.verdicts.get(chosen.choice)
        if verdict is not None and verdict.status == "fits" and verdict.readable and ours is not None \
                and ours.readable:
            # Both compiled and fit: their programs ranked them, not the formula.
            slower = verdict.time.step_s / ours.time.step_s - 1
            return (f"{slower:.1%} slower by the compiled programs ({duration(verdict.time.step_s)} vs "
                    f"{duration(ours.time.step_s)} a step; both fit)")
        if verdict is not None and verdict.status == "fits" and verdict.time is not None and not verdict.readable \
                and ours is not None and ours.readable:
            return (f"fits, but its compiled program reads {verdict.time.mfu:.0%} MFU, above the chip's peak (not read "
                    f"whole); by the formula {duration(item.time.step_s)} against {duration(ours.time.step_s)} "
                    "compiled a step")
        if item.choice in self.passed:
            return self.passed[item.choice]
        if item.memory.total > self.hbm:
            return f"predicted {gib(item.memory.total)} > {gib(self.hbm)} HBM"
        budget = memory.host_budget(item.choice)
        if item.memory.host > budget:
            return f"offloads {gib(item.memory.host)} per device, more than the host's {gib(budget)}"
        if self.margin is not None and item.memory.total > self.margin >= chosen.memory.total:
            return f"predicted {gib(item.memory.total)}, beyond the {gib(self.margin)} kept without XLA's verdict"
        slower = item.time.step_s / chosen.time.step_s - 1
        if slower > 0.0005:
            return f"{slower:.1%} slower ({duration(item.time.step_s)} vs {duration(chosen.time.step_s)} a step)"
        if slower < -0.0005 and uses_memory_lever(item) and not uses_memory_lever(chosen):
            return (f"{-slower:.1%} faster, but with a memory lever (host offload or sequence parallelism), "
                    f"put first only where it is search.LEVER_GAIN times as fast as the best plan without one "
                    f"(of its expert path)")
        if item.choice.microbatches != chosen.choice.microbatches:
            return f"as fast, with {item.choice.microbatches} microbatches instead of {chosen.choice.microbatches}"
        if item.choice.remat.endswith("offloaded") and not chosen.choice.remat.endswith("offloaded"):
            return "as fast, but it offloads to host memory"
        return f"as fast, with more memory ({gib(item.memory.total)} vs {gib(chosen.memory.total)})"

    def candidate(self, item: Scored, chosen: Scored) -> Candidate:
        choice = item.choice
        return Candidate(mesh={a: choice.mesh[a] for a in MESH_AXES if choice.mesh[a] > 1} or {"data": 1},
                         remat=choice.remat, microbatches=choice.microbatches,
                         predicted_bytes=item.memory.total, step_s=item.time.step_s,
                         lost_because=self.why_lost(item, chosen), loss_chunks=choice.loss_chunks)

    def losers(self, chosen: Scored, fitting: list[Scored], scored: list[Scored]) -> list[Candidate]:
        """The candidates XLA judged first, then the next best; and the fastest of all when it
        does not fit, which says what memory is costing."""
        ordered = [c for c in fitting if c.choice in self.verdicts] + [c for c in fitting if c.choice not in self.verdicts]
        out = [self.candidate(item, chosen) for item in ordered if item is not chosen][:CANDIDATES_SHOWN]
        fastest = min(scored, key=rank)
        if not fits(fastest, self.hbm):
            out.append(self.candidate(fastest, chosen))
        return out

    def reasons(self, chosen: Scored, fitting: list[Scored], scored: list[Scored]) -> list[str]:
        choice = chosen.choice
        reasons = [f"the fastest of {len(fitting)} candidates predicted to fit "
                   f"({gib(chosen.memory.total)} of {gib(self.hbm)}), of {len(scored)} considered"]
        knobs = {
            "mesh": (lambda c: (c.mesh_key(), tuple(c.dcn.items())), mesh_text),
            "remat": (lambda c: c.remat, lambda c: c.remat),
            "microbatches": (lambda c: c.microbatches, lambda c: str(c.microbatches)),
            "loss": (lambda c: c.loss_chunks, _loss_text),
            "optimizer state": (lambda c: c.optimizer_on_host, _optimizer_text),
        }
        for knob, (key, text) in knobs.items():
            others = [s for s in scored if key(s.choice) != key(choice)
                      and all(k(s.choice) == k(choice) for name, (k, _) in knobs.items() if name != knob)]
            if others:
                best = min(others, key=lambda s: (not fits(s, self.hbm), rank(s)))
                reasons.append(f"{knob} {text(choice)}: the best other ({text(best.choice)}) is "
                               f"{self.why_lost(best, chosen)}")
        reasons += [f"rules: {note}" for note in choice.rule_notes]
        reasons += stage_reasons(chosen)
        reasons.append(f"attention {choice.attention}: "
                       + ("Pallas flash attention, scores never materialised" if choice.attention == "splash"
                          else "the XLA path (splash needs TPU, whole sequences per device, seq % 128 == 0)"))
        return reasons


def _loss_text(choice) -> str:
    return (f"in {choice.loss_chunks} pieces of the sequence (each piece's logits recomputed in the backward)"
            if choice.loss_chunks > 1 else "over the whole float32 logits")


def _optimizer_text(choice) -> str:
    return ("in host memory between steps (its update's copies over the host link every step)"
            if choice.optimizer_on_host else "in HBM")
