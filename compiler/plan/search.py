"""The search: every candidate the pins allow (candidates.py), ranked by estimated step time among
those predicted to fit; then XLA compiles the best ones for the real topology and its memory
analysis decides. A candidate XLA rejects (or reports over HBM) gives way to the next.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Iterator, Mapping

from mxc.compiler.plan import memory
from mxc.compiler.plan.advice import advice
from mxc.compiler.plan.candidates import (Scored, attention_for, choices, condemned_with_moments_on_host,
                                          describe, expert_settings, fits,
                                          gib, on_capacity_path, rank, score, uses_memory_lever,
                                          with_optimizer_on_host, without_needless_pieces)
from mxc.compiler.plan.choice import Choice
from mxc.compiler.plan.explain import Verdicts
from mxc.compiler.plan.layout import parameters
from mxc.compiler.plan.plan import MESH_AXES, Lowering, Plan, Verification, spec_hash
from mxc.compiler.plan.rules import SEQUENCE_PARALLEL, make_rules
from mxc.compiler.plan.stages import pipeline_for, with_stage_rules
from mxc.compiler.topology import Topology
from mxc.spec.ir import ModelSpec

# Without XLA's verdict, plans within this share of HBM come first: the prediction's error on the
# plans XLA verified is within 10% (docs/plans.md).
UNVERIFIED_SHARE = 0.9
# A plan with a memory lever goes before the plans without only when it is estimated this many
# times as fast as the fastest of them. 1: as soon as it is faster, since the memory model holds
# MaxText's one-microbatch offloading settings within 7% of XLA (memory.SQUEEZED_SHARE; at 1.25
# the search took 5 microbatches for Llama 3.1 70B on v6e-256, estimated 0.85x MaxText's setting).
LEVER_GAIN = 1.0
# `compare="auto"` (the default): after the first candidate XLA fits, the next fitting candidates
# whose formula step time is within this share of it are compiled too, and the compiled programs
# rank them. The formula's step-time error against the compiled programs differs between kinds of
# plan by 3-8% (docs/plans.md, "The analytic model": -1.7% on Llama 3.1 8B's 4-microbatch plan,
# +6.6% on its one-microbatch setting; +2.9% and 0% on Llama 2 70B's), so gaps this small do not
# decide; 2% takes in the near-ties measured (70B 0.5%, 8B 1.1%) and few others.
TIE_BAND = 0.02
# Issue 17 asks every large model to plan in under 10 minutes on this host: a tie compile is
# skipped where the time spent so far plus the slowest compile so far would pass this.
PLANNING_BUDGET_S = 600.0
# With `attempts=None` (the default), the compiles the search makes before giving up, and past
# them more while none has fit and the planning budget allows (DeepSeek V3 671B on v5p-512 fits
# at the fourth, docs/plans.md "The largest models").
MIN_ATTEMPTS = 3


def _now() -> float:
    return time.monotonic()


class PlanError(ValueError):
    """The request cannot be planned at all (pins that contradict the topology, ...)."""


def plan(spec: ModelSpec, topology: Topology, *, seq: int, batch: int, pins: Mapping[str, int] | None = None,
         remat: str | None = None, microbatches: int | None = None, verify: bool = True, attempts: int | None = None,
         compare: int | str = "auto", progress: Callable[[str], None] | None = None) -> Plan:
    """The fastest plan XLA agrees fits; or, where none fits, the smallest one, with advice. With
    `compare` a number K, up to K candidates that fit (within `attempts` compiles) are ranked by
    their compiled programs' estimates instead of the formula's; with "auto", the first that fits and
    those after it within TIE_BAND of its formula step time (within `attempts` and the planning
    budget; on TPUs only, elsewhere the first that fits). `attempts` None: MIN_ATTEMPTS compiles, and
    more while none fits and the planning budget allows."""
    say = progress or (lambda message: None)
    started = _now()
    pins = _merge_pins(spec, dict(pins or {}))
    if seq > spec.max_seq:
        raise PlanError(f"--seq {seq} exceeds {spec.name}'s max_seq {spec.max_seq}")
    if topology.chips < 1:
        raise PlanError(f"{topology.name} has no fixed device count to plan for; name a topology")
    params = _parameters(spec)
    scored = with_optimizer_on_host(
        without_needless_pieces([score(choice) for choice in
                                 choices(spec, params, topology, seq, batch, pins, remat, microbatches)],
                                topology.usable_hbm_bytes), topology.usable_hbm_bytes)
    if not scored:
        raise PlanError(_nothing_enumerated(spec, topology, batch, pins))
    hbm = topology.usable_hbm_bytes
    judged = verify and topology.platform != "gpu"
    margin = hbm if judged else UNVERIFIED_SHARE * hbm
    fitting = compile_order([s for s in scored if fits(s, hbm)], margin)
    say(f"{len(scored)} candidates, {len(fitting)} predicted to fit in {gib(hbm)}")
    if not fitting:
        return _no_fit(spec, params, topology, seq, batch, pins, scored)

    verdicts: dict[Choice, Verification] = {}
    passed: dict[Choice, str] = {}  # candidates a refusal condemned, and why
    chosen = fitting[0]
    fitted: list[Scored] = []  # compiled and fitting, in the order compiled
    ties: list[str] = []  # with compare="auto": the tie compiles run or skipped, and why
    if not verify:
        verdicts[chosen.choice] = Verification(status="skipped", reason="--no-verify")
    else:
        unavailable = None
        slowest = [0.0]  # the longest compile so far, in seconds
        # Tie compiles only on TPUs: the compiled programs' estimate is calibrated on TPU programs
        # alone (calibration.py), so elsewhere it cannot break a tie better than the formula.
        auto = compare == "auto" and topology.platform == "tpu"

        def wanted(item: Scored) -> str:
            """Why `item` is not compiled ("" where it is): with "auto", past the first plan that
            fits, only near-ties, and only while the planning budget allows."""
            if not (auto and fitted):
                return ""
            gap = item.time.step_s / fitted[0].time.step_s - 1
            if abs(gap) > TIE_BAND:
                return "stop"
            elapsed = _now() - started
            if elapsed + slowest[0] > PLANNING_BUDGET_S:
                why = (f"tie compile skipped: {describe(item.choice)}, {gap:+.1%} by the formula; "
                       f"{elapsed:.0f} s spent plus the slowest compile so far ({slowest[0]:.0f} s) "
                       f"would pass the {PLANNING_BUDGET_S:.0f} s planning budget")
                ties.append(why)
                passed[item.choice] = why
                return "stop"
            return ""

        def more() -> bool:
            """Past MIN_ATTEMPTS, with the default `attempts`: whether to compile one more."""
            return attempts is None and not fitted and _now() - started + slowest[0] <= PLANNING_BUDGET_S

        for candidate in _to_compile(fitting, verdicts, attempts or MIN_ATTEMPTS, passed, wanted, more):
            if auto and fitted:
                ties.append(f"tie compiled: {describe(candidate.choice)}, "
                            f"{candidate.time.step_s / fitted[0].time.step_s - 1:+.1%} by the formula against "
                            f"{describe(fitted[0].choice)} (within {TIE_BAND:.0%})")
            say(f"compiling the train step for {describe(candidate.choice)} ...")
            begun = _now()
            verdict = _verify(spec, candidate, topology)
            slowest[0] = max(slowest[0], _now() - begun)
            verdicts[candidate.choice] = verdict
            say(f"  {verdict.status}" + (f": {verdict.reason}" if verdict.reason else ""))
            if verdict.status == "unavailable":
                unavailable = candidate
                break
            if verdict.status == "fits":
                fitted.append(candidate)
                # Without the compiled program's estimate there is nothing better to rank by.
                if (not auto and len(fitted) >= (1 if compare == "auto" else compare)) or verdict.time is None:
                    break
        if unavailable is not None:
            chosen = unavailable
        elif fitted:
            chosen = min(fitted, key=lambda c: _compiled_step_s(c, verdicts[c.choice]))
        else:
            chosen = min((c for c in fitting if c.choice in verdicts), key=rank)
    verdict = verdicts[chosen.choice]
    fits_now = verdict.status == "fits" or (verdict.status in ("unavailable", "skipped") and chosen.memory.total <= hbm)
    explain = Verdicts(verdicts, hbm, None if judged else margin, passed)
    reasons = explain.reasons(chosen, fitting, scored)
    if not judged:
        reasons.append(f"without XLA's verdict, plans within {UNVERIFIED_SHARE:.0%} of HBM ({gib(margin)}) come "
                       "first, to leave room for the prediction's error"
                       + ("" if chosen.memory.total <= margin else "; none was, so this one is closer to the limit"))
    reasons.extend(ties)
    if len(fitted) > 1:
        reasons.append("ranked by their compiled programs' estimates among the " + str(len(fitted)) + " that fit: "
                       + ", ".join(f"{describe(c.choice)} {_compiled_step_s(c, verdicts[c.choice]):.2f} s"
                                   + ("" if verdicts[c.choice].time is None or verdicts[c.choice].readable else
                                      f" (the formula's: its program reads {verdicts[c.choice].time.mfu:.0%} MFU, "
                                      "above the chip's peak)")
                                   for c in fitted))
    if verdict.status not in ("fits", "unavailable", "skipped"):
        reasons.append(f"XLA refused every candidate tried ({len(verdicts)}); shown: the fastest predicted. "
                       "--attempts tries more")
    return _plan_value(spec, topology, seq, batch, pins, chosen, verdict, fits_now).model_copy(
        update={"reasons": reasons, "candidates": explain.losers(chosen, fitting, scored)})


def _compiled_step_s(candidate: Scored, verdict: Verification) -> float:
    """The step time from the compiled program where XLA's program could be read whole
    (Verification.readable), else the formula's."""
    if verdict.readable:
        return verdict.time.step_s
    return candidate.time.step_s


def evaluate(spec: ModelSpec, topology: Topology, *, seq: int, batch: int, mesh: Mapping[str, int],
             remat: str, sequence_parallel: bool = False, microbatches: int = 1, dcn: Mapping[str, int] | None = None,
             attention: str | None = None, experts: tuple[str | None, float | None] | None = None,
             loss_chunks: int = 1, optimizer_on_host: bool = False) -> Plan:
    """One fixed setting (a recipe's mesh, remat and batch) as a Plan with its predicted memory
    and step time; not compiled (verify.verify judges it)."""
    params = _parameters(spec)
    sizes = {axis: mesh.get(axis, 1) for axis in MESH_AXES}
    if math.prod(sizes.values()) != topology.chips:
        raise PlanError(f"mesh {dict(mesh)} does not cover the {topology.chips} devices of {topology.name}")
    if dcn is None and topology.slices > 1:
        dcn = {next(a for a in ("data", "fsdp") if sizes[a] % topology.slices == 0): topology.slices}
    rules, notes = make_rules(sizes, params.tensors, {k: tuple(v) for k, v in spec.shard.items()})
    rules = with_stage_rules(rules, sizes, params.tensors)  # a recipe's pipeline stages
    if sequence_parallel:  # the residual stream's sequence split over tensor too
        rules["residual_seq"] = SEQUENCE_PARALLEL
    choice = Choice(spec, params, topology, sizes, dict(dcn or {}), rules, seq, batch, microbatches, remat,
                    attention or attention_for(topology, seq, sizes["context"], spec), tuple(notes),
                    loss_chunks=loss_chunks, optimizer_on_host=optimizer_on_host)
    choice = replace(choice, **dict(zip(("expert_path", "capacity_factor"), experts or expert_settings(choice)[0])))
    item = score(choice)
    verdict = Verification(status="skipped", reason="not compiled")
    result = _plan_value(spec, topology, seq, batch, {}, item, verdict, item.memory.total <= topology.usable_hbm_bytes)
    return result.model_copy(update={"reasons": [f"rules: {note}" for note in notes]})


def _parameters(spec: ModelSpec):
    from mxc.compiler.lower.params import UnsupportedError

    try:
        return parameters(spec)
    except UnsupportedError as err:
        raise PlanError(f"{spec.name} cannot be planned: the lowering cannot build it ({err})") from None


def _merge_pins(spec: ModelSpec, command_line: dict[str, int]) -> dict[str, int]:
    """The spec's `mesh` pins, overridden by the command line's."""
    pins = {axis: size for axis, size in spec.mesh.items()}
    pins.update(command_line)
    unknown = sorted(set(pins) - set(MESH_AXES))
    if unknown:
        raise PlanError(f"unknown mesh axis {unknown[0]!r} in a pin; the axes are {', '.join(MESH_AXES)}")
    return pins


def compile_order(fitting: list[Scored], margin: float) -> list[Scored]:
    """The candidates predicted to fit, in the order the search compiles them: those within
    `margin` first; MoE layers drop tokens (the capacity path) only where no dropless plan fits;
    memory levers (host offload, sequence parallelism) only where no plan without them fits, or
    where they are estimated faster than every plan without one of their expert path (a capacity
    plan comes after every dropless one anyway): the memory model's error on them is not yet
    within what XLA verifies (docs/plans.md), so XLA's verdict decides."""
    plain = {path: min((s.time.step_s for s in fitting if on_capacity_path(s) == path and not uses_memory_lever(s)
                        and s.memory.total <= margin), default=math.inf) for path in (False, True)}
    return sorted(fitting, key=lambda s: (s.memory.total > margin, on_capacity_path(s),
                                          uses_memory_lever(s) and s.time.step_s * LEVER_GAIN > plain[on_capacity_path(s)],
                                          rank(s)))


def _to_compile(fitting: list[Scored], verdicts: dict, attempts: int,
                passed: dict | None = None, wanted: Callable[[Scored], str] | None = None,
                more: Callable[[], bool] | None = None) -> Iterator[Scored]:
    """Candidates to compile, in the search's order, up to `attempts`, passing over those a refusal
    already condemns. Where the memory model squeezes a candidate's temporaries (memory.squeezed),
    its prediction rests on their irreducible part fitting the room beside the state; XLA's refusal
    of such a candidate says that part is under-predicted there, so the squeezed candidates whose
    irreducible part takes at least the same share of their room are passed over, and the others
    keep their order (Llama 3.1 405B on 2 x v6e-256: fsdp 256 x tensor 2 refused, its irreducible
    part 11.1 GiB of 19.4, 0.57; MaxText's fsdp 128 x tensor 4, 6.9 of 19.4, fits). Once XLA
    refuses a candidate that was not squeezed, the unsqueezed ones predicted to need at least as
    much are passed over (`passed` receives them, with why). `wanted`, asked just before each
    candidate would be compiled, says why not ("" to compile it, "stop" to end here); `more`, asked
    once `attempts` are spent, whether to go on."""
    pending, tried = list(fitting), 0
    while pending and (tried < attempts or (more is not None and more())):
        item = pending.pop(0)
        refused = [r for r in fitting if r.choice in verdicts and verdicts[r.choice].out_of_memory]
        why = _condemned(item, refused) or condemned_with_moments_on_host(
            item, [(r, verdicts[r.choice]) for r in fitting if r.choice in verdicts])
        if why:
            if passed is not None:
                passed[item.choice] = why
            continue
        unwanted = wanted(item) if wanted else ""
        if unwanted == "stop":
            return
        if unwanted:
            if passed is not None:
                passed[item.choice] = unwanted
            continue
        tried += 1
        yield item


def _squeezed_share(item: Scored) -> float | None:
    """The share of the room beside the state that a squeezed candidate's irreducible temporaries
    take; None where its temporaries are not squeezed."""
    irreducible = item.squeezed_to
    if irreducible is None:
        return None
    room = item.choice.topology.usable_hbm_bytes - (item.memory.total - item.memory.temporaries)
    return irreducible / room if room > 0 else math.inf


def _condemned(item: Scored, refused: list[Scored]) -> str:
    """Why a refusal condemns `item` ("" where none does)."""
    share = _squeezed_share(item)
    for r in refused:
        refused_share = _squeezed_share(r)
        if share is not None and refused_share is not None and share >= refused_share * (1 - 1e-9):
            return (f"passed over: XLA refused {describe(r.choice)}, whose irreducible temporaries take "
                    f"{refused_share:.2f} of the room beside its state; this one's take {share:.2f}")
        if share is None and refused_share is None and r.memory.total <= item.memory.total:
            return (f"passed over: XLA refused {describe(r.choice)}, predicted {gib(r.memory.total)}; "
                    f"this one is predicted {gib(item.memory.total)}")
    return ""


def _verify(spec: ModelSpec, candidate: Scored, topology: Topology) -> Verification:
    from mxc.compiler.plan.verify import verify

    choice = candidate.choice
    draft = _plan_value(spec, topology, choice.seq, choice.batch, {}, candidate, Verification(status="skipped"), True)
    return verify(spec, draft, topology)


def _plan_value(spec, topology: Topology, seq: int, batch: int, pins, item: Scored, verdict: Verification,
                fits_now: bool) -> Plan:
    choice = item.choice
    return Plan(
        model=spec.name, spec_hash=spec_hash(spec), topology=topology.name, slices=topology.slices,
        chips=topology.chips,
        chip=topology.chip.name, hbm_bytes=topology.usable_hbm_bytes, seq=seq, batch=batch,
        mesh=dict(choice.mesh), dcn=dict(choice.dcn),
        rules={k: list(v) for k, v in choice.rules.items()}, remat=choice.remat,
        microbatches=choice.microbatches, pipeline=pipeline_for(spec, choice.mesh.get("stage", 1), choice.microbatches),
        attention=choice.attention, expert_path=choice.expert_path,
        capacity_factor=choice.capacity_factor,
        lowering=_lowering_for(topology).model_copy(update={"loss_chunks": choice.loss_chunks,
                                                            "optimizer_state_on_host": choice.optimizer_on_host}),
        pins=dict(pins),
        fits=fits_now,
        predicted=item.memory, serving_kv_cache=memory.kv_cache_bytes(choice, seq), xla=verdict, time=verdict.time or item.time)


def _lowering_for(topology: Topology) -> Lowering:
    from mxc.compiler.lower.choices import LoweringChoices

    choices = LoweringChoices.for_platform(topology.platform)
    return Lowering(**{name: getattr(choices, name) for name in Lowering.model_fields})


def _nothing_enumerated(spec: ModelSpec, topology: Topology, batch: int, pins) -> str:
    pinned = ", ".join(f"{k}={v}" for k, v in pins.items())
    if topology.chips % math.prod(pins.values()):
        return (f"the pins {pinned} multiply to {math.prod(pins.values())}, which does not divide the "
                f"{topology.chips} devices of {topology.name}")
    return (f"no mesh of {topology.chips} devices splits a batch of {batch} for {spec.name}"
            + (f" with pins {pinned}" if pinned else "")
            + "; the batch must be a multiple of the devices that split it (data x fsdp x expert)")


def _no_fit(spec, params, topology: Topology, seq: int, batch: int, pins, scored: list[Scored]) -> Plan:
    smallest = min(scored, key=lambda s: (s.memory.total, s.time.step_s))
    verdict = Verification(status="skipped", reason="nothing is predicted to fit; nothing compiled")
    state = smallest.memory.parameters + smallest.memory.optimizer_state + smallest.memory.gradients
    reasons = [f"no candidate fits: the smallest ({describe(smallest.choice)}) needs {gib(smallest.memory.total)} "
               f"per device, {gib(topology.usable_hbm_bytes)} available",
               f"parameters, gradients and AdamW state alone: {gib(state)} per device"]
    return _plan_value(spec, topology, seq, batch, pins, smallest, verdict, False).model_copy(
        update={"reasons": reasons, "advice": advice(spec, params, topology, seq, batch, pins, smallest)})
