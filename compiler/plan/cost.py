"""Estimated time of one train step: compute, HBM traffic and communication, per device.

    compute        executed FLOPs at the chip's peak: MaxText's training count (6 per weight
                   per token, causal attention counted half) plus the forward matmuls the remat
                   policy makes the backward redo
    memory         bytes that non-matmul work moves through HBM at its bandwidth: every
                   intermediate written and read forward and backward (again where the
                   backward recomputes it), float32 logits, the AdamW update, the FSDP
                   collectives' buffers
    communication  ring collectives, (n-1)/n of the data over the axis's bandwidth (twice for an
                   all-reduce): FSDP's all-gathers of weights and reduce-scatters of gradients,
                   data parallelism's gradient all-reduce, tensor parallelism's activation
                   all-reduces, the experts' all-to-alls, context parallelism's key/value
                   all-gathers

Matmuls are bound by FLOPs and everything else (norms, activations, the loss, the optimizer
update) by HBM bandwidth, so the step adds the two; host offloading overlaps with that work,
while collectives sit on the critical path (the compiled programs issue them synchronously).
An axis inside a slice gets the share of the chip's ICI links that its size spans of the slice
(log2 n of log2 chips); the part of an axis that spans slices runs over DCN.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mxc.compiler.analysis import attention_flops_per_token, summarize
from mxc.compiler.kinds import kind_of
from mxc.compiler.plan.activations import (RECOMPUTED, layer_bytes, layer_recomputed_bytes, layer_working_bytes,
                                           megablox_region)
from mxc.compiler.plan.choice import Choice, layer_counts
from mxc.compiler.plan.memory import hosted_moment_bytes, logits_bytes, parameter_bytes
from mxc.compiler.plan.plan import StepTime
from mxc.spec.ir import MoE

# AdamW's update reads parameter, gradient and both moments and writes three of them back.
UPDATE_ACCESSES = 7
# Host memory behind each chip, per direction: a PCIe 4.0 x16 link (PCI-SIG: 16 GT/s x 16 lanes,
# about 32 GB/s), and PCIe 5.0 (32 GT/s, about 64 GB/s at x16) where the chip's page says it
# connects to its host through PCIe Gen5 (Google's v6e page). The lane count is an assumption
# about the hosts, not a datasheet figure: offloaded activations are charged at this rate,
# overlapped with compute.
HOST_BANDWIDTH = 32e9
HOST_BANDWIDTH_BY_CHIP = {"v6e": 64e9}


def host_bandwidth(chip) -> float:
    """Bytes/s per direction between one chip and its host's memory."""
    return HOST_BANDWIDTH_BY_CHIP.get(chip.name, HOST_BANDWIDTH)


def attention_mxu_factor(att, chip) -> float:
    """How much longer a flash attention kernel's matmuls keep the MXUs busy than their FLOPs
    say: a head dimension that is not a multiple of the MXU's side is padded to one (head_dim 128
    fills half of v6e's 256-wide array; MLA's 192 three quarters of two 128-wide passes). Of the
    kernel's seven passes (forward QK^T and PV; backward QK^T again, dP = dO V^T, dV, dQ, dK)
    four run over the query/key head dimension and three over the value head dimension, each
    in proportion to it. 1 where the chip has no systolic array."""
    if not chip.mxu_width:
        return 1.0
    qk, v = att.head_dim, kind_of(att).value_head_dim(att)
    padded = lambda d: -(-d // chip.mxu_width) * chip.mxu_width  # noqa: E731
    return (4 * padded(qk) + 3 * padded(v)) / (4 * qk + 3 * v)


def _matmul_flops_per_token(block, d_model: int) -> dict[str, float]:
    """Forward FLOPs per token of one layer's matmuls, by the groups remat policies recompute."""
    att, ffn = block.attention, block.mlp
    qkv, out = kind_of(att).projection_weights(att, d_model)
    return {"qkv": 2 * qkv, "out": 2 * out, "mlp_in": 2 * kind_of(ffn).input_weights_per_token(ffn, d_model)}


_MODEL_FLOPS: dict[tuple[int, int], tuple[object, float]] = {}


def model_flops_per_token(spec, seq: int) -> float:
    """MaxText's training FLOPs per token (mxc.compiler.analysis), remembered per spec and seq."""
    key = (id(spec), seq)
    if key not in _MODEL_FLOPS:
        _MODEL_FLOPS[key] = (spec, summarize(spec, seq).train_flops_per_token)  # holds spec: ids stay unique
    return _MODEL_FLOPS[key][1]


def executed_flops_per_token(choice: Choice, constants=None) -> tuple[float, float]:
    """(model FLOPs per token, FLOPs actually executed per token) for training; kernels that wait
    on HBM (megablox's) count as the FLOPs the MXUs would do meanwhile, at `constants` (FITTED)."""
    spec = choice.spec
    model = model_flops_per_token(spec, choice.seq)
    redo = 0.0
    recomputed = RECOMPUTED[choice.remat]
    for name, count in layer_counts(spec).items():
        block = spec.blocks[name]
        groups = _matmul_flops_per_token(block, spec.d_model)
        redo += count * sum(groups[g] for g in recomputed if g in groups)
        core = attention_flops_per_token(block.attention, choice.seq)
        if "core" in recomputed:
            redo += count * core / 3
        passes = core * (1 + ("core" in recomputed) / 3)
        if not choice.attention.startswith("splash"):
            # Without a flash kernel the masked half of the scores is computed too.
            redo += count * passes
        else:  # the kernel's passes as long as the MXUs take to run them (attention_mxu_factor)
            redo += count * passes * (attention_mxu_factor(block.attention, choice.topology.chip) - 1)
        if kind_of(block.mlp).routing(block.mlp) is not None and choice.expert_path == "capacity":
            redo += count * _capacity_overhead_per_token(block.mlp, spec.d_model, choice)
        elif _runs_megablox(name, choice):
            redo += count * _grouped_tile_overhead_per_token(block.mlp, spec.d_model, choice, recomputed, constants)
    if choice.loss_chunks > 1:  # the backward recomputes each piece's logits: the head's forward again
        redo += 2 * spec.d_model * spec.vocab
    return model, model + redo


def _capacity_overhead_per_token(moe: MoE, d_model: int, choice: Choice) -> float:
    """Training FLOPs per token the capacity path adds: every expert's empty slots are computed,
    and dispatch and combine are einsums over [seq, experts, slots, embed]."""
    from mxc.compiler.lower.moe import capacity

    slots = capacity(choice.seq, moe.top_k, moe.experts, choice.capacity_factor)
    filled = moe.experts * slots / (moe.top_k * choice.seq)  # rows computed per row routed
    inputs = kind_of(moe.expert).input_projections
    expert = 6 * (inputs + 1) * d_model * moe.expert.hidden * moe.top_k
    dispatch = 6 * 2 * moe.experts * slots * d_model  # two einsums, forward and backward
    return (filled - 1) * expert + dispatch


def _runs_megablox(block_name: str, choice: Choice) -> bool:
    """Whether a layer's routed experts run megablox's grouped matmul: the dropless path on TPU,
    split over an expert axis (the dispatch's kernel) or unsplit where the layout allows it."""
    ffn = choice.spec.blocks[block_name].mlp
    if kind_of(ffn).routing(ffn) is None or choice.expert_path != "dropless" or choice.topology.platform != "tpu":
        return False
    return choice.split("experts") > 1 or megablox_region(block_name, choice)


def _grouped_tile_overhead_per_token(moe: MoE, d_model: int, choice: Choice, recomputed, constants=None) -> float:
    """Training FLOPs per token megablox adds over its rows' own, in time at the MXUs' rate: its
    grid visits a row tile once more for each local group that starts inside one
    (megablox.visited_tiles), a whole tile's FLOPs (its widths padded) each time, and a visit that
    moves more bytes than the HBM delivers in its FLOPs' time takes the bytes' time
    (megablox.call_visit), with the tiles the lowering picks for the chip (megablox.tiling)."""
    from mxc.compiler.lower.choices import LoweringChoices
    from mxc.compiler.lower.megablox import call_visit, tiling, visited_tiles
    from mxc.compiler.plan.calibration import FITTED

    c, chip = constants or FITTED, choice.topology.chip
    groups = moe.experts // choice.split("experts")
    filled = choice.local_tokens * moe.top_k  # a device's rows; under balanced routing it receives as many
    buffer = filled * choice.split("experts")  # the dispatch's receive buffer has room for every sender's
    lowering = LoweringChoices.for_chip(chip)
    balance = chip.peak_bf16_flops * c.matmul / (chip.hbm_bandwidth * c.hbm)  # FLOPs per byte at the constants
    d, h, inputs = d_model, moe.expert.hidden, kind_of(moe.expert).input_projections
    again = "mlp_in" in recomputed  # the policy recomputes the input products' forward

    def runs(k: int, n: int, recompute: bool) -> float:  # a product's calls, in its useful FLOPs' time
        chosen = tiling(buffer, groups, k, n, lowering.grouped_flops_per_byte, lowering.grouped_vmem_bytes)
        time = {}
        for call, tiles in chosen.calls().items():
            flops, moved = call_visit(call, tiles, chosen.k, chosen.n)
            waste = visited_tiles(-(-filled // tiles[0]), groups) * tiles[0] / filled
            time[call] = waste * max(flops, moved * balance) / (2 * tiles[0] * k * n)
        return sum(time.values()) + recompute * time["forward"]

    # gate/up, then down: (k, n) of the forward's products; 2·d·h FLOPs a row and call each.
    total = inputs * runs(d, h, again) + runs(h, d, False)
    useful = 3 * (inputs + 1) + again * inputs
    return 2 * d * h * moe.top_k * (total - useful)


def _axis_bandwidth(choice: Choice, axis: str) -> tuple[float, int, int]:
    """(ICI bytes/s for a ring over the axis inside a slice, devices in a slice, slices spanned)."""
    topology = choice.topology
    size = choice.mesh.get(axis, 1)
    across = choice.dcn.get(axis, 1)
    inside = size // across
    per_slice = max(topology.chips_per_slice, 2)
    share = math.log2(inside) / math.log2(per_slice) if inside > 1 else 0.0
    return topology.chip.ici_bandwidth / 2 * max(share, 1e-9), inside, across


def ring_seconds(choice: Choice, axes: tuple[str, ...], data_bytes: float, all_reduce: bool = False) -> float:
    """One all-gather or reduce-scatter (all-reduce: twice that) of `data_bytes` (the whole,
    gathered size) over the mesh axes `axes` together, hierarchically: inside slices over ICI,
    then across slices over DCN."""
    seconds = 0.0
    remaining = data_bytes
    for axis in axes:
        bandwidth, inside, across = _axis_bandwidth(choice, axis)
        if inside > 1:
            seconds += (inside - 1) / inside * remaining / bandwidth
            remaining /= inside
        if across > 1:
            seconds += (across - 1) / across * remaining / choice.topology.chip.dcn_bandwidth
            remaining /= across
    return seconds * (2 if all_reduce else 1)


def _gathered_axes(choice: Choice) -> tuple[str, ...]:
    """Mesh axes over which weights are split only to save memory (FSDP in the broad sense)."""
    return tuple(axis for axis in choice.rules.get("embed", ()) if choice.mesh.get(axis, 1) > 1)


def _model_gathered_bytes(choice: Choice) -> float:
    """Every parameter gathered whole over the FSDP axes, in the compute dtype, one device's share
    of the tensor and expert splits."""
    return choice.memo("model_gathered_bytes", lambda: choice.compute_bytes * sum(
        choice.local(t.shape, t.axes) * choice.gather_factor(t.axes) for t in choice.params.tensors))


def communication(choice: Choice) -> dict[str, float]:
    spec = choice.spec
    seconds: dict[str, float] = {}
    microbatches = choice.microbatches
    fsdp_axes = _gathered_axes(choice)
    gathered = _model_gathered_bytes(choice)
    if fsdp_axes:
        # Forward and backward each gather the weights; gradients leave as a reduce-scatter.
        seconds["fsdp all-gather"] = 2 * microbatches * ring_seconds(choice, fsdp_axes, gathered)
        grads = gathered / choice.compute_bytes * choice.param_bytes
        seconds["fsdp reduce-scatter"] = microbatches * ring_seconds(choice, fsdp_axes, grads)
    data = choice.mesh.get("data", 1)
    if data > 1:
        local_grads = parameter_bytes(choice)
        seconds["data all-reduce"] = ring_seconds(choice, ("data",), local_grads, all_reduce=True)
    tensor = choice.mesh.get("tensor", 1)
    layers = spec.num_layers
    residual = choice.local_tokens * spec.d_model * choice.compute_bytes
    if tensor > 1:
        # Two all-reduces of the residual stream per layer forward, two backward, two more when
        # the backward recomputes the forward; one more each way at the output head.
        passes = 6 if RECOMPUTED[choice.remat] else 4
        per_microbatch = (passes * layers + 2) * ring_seconds(choice, ("tensor",), residual, all_reduce=True)
        seconds["tensor all-reduce"] = microbatches * per_microbatch
    expert = choice.mesh.get("expert", 1)
    kinds = layer_counts(spec)
    routings = {n: kind_of(spec.blocks[n].mlp).routing(spec.blocks[n].mlp) for n in kinds}
    routed = sum(count * routings[n].top_k for n, count in kinds.items() if routings[n] is not None)
    if expert > 1 and routed:
        per_layer = routed * residual
        # Dispatch and combine, forward and backward, and again when the forward is recomputed.
        passes = 6 if RECOMPUTED[choice.remat] else 4
        # An all-to-all sends (n-1)/n of a device's routed tokens away, the volume of a ring pass.
        seconds["expert all-to-all"] = microbatches * ring_seconds(choice, ("expert",), passes * per_layer)
    context = choice.mesh.get("context", 1)
    if context > 1:
        kv = sum(count * 2 * spec.blocks[n].attention.kv_heads * spec.blocks[n].attention.head_dim
                 for n, count in kinds.items())
        whole = choice.local_tokens * context * kv * choice.compute_bytes
        # Keys and values gathered forward, their gradients reduce-scattered backward.
        seconds["context all-gather"] = 2 * microbatches * ring_seconds(choice, ("context",), whole)
    return seconds


def hbm_traffic(choice: Choice) -> float:
    """Bytes that work other than matmuls moves through HBM in one step (matmuls are counted as
    compute: at these sizes they are bound by FLOPs, and their operands stream through once)."""
    spec = choice.spec
    microbatches = choice.microbatches
    produced = sum(count * layer_working_bytes(name, choice)
                   for name, count in layer_counts(spec).items())
    recomputed = sum(count * layer_recomputed_bytes(name, choice) for name, count in layer_counts(spec).items())
    # Norms, activations, RoPE, residual adds: each intermediate written and read forward, its
    # gradient written and read backward; what the policy does not keep is written and read once
    # more where the backward recomputes it (what it keeps is not redone).
    activations = microbatches * (4 * produced + 2 * recomputed)
    # Float32 logits written, read by the log-sum-exp, read again for their gradient; over pieces
    # of the sequence, written and read once more where the backward recomputes them.
    logits = microbatches * (3 + 2 * (choice.loss_chunks > 1)) * logits_bytes(choice)
    update = UPDATE_ACCESSES * parameter_bytes(choice)
    if microbatches > 1:
        update += 2 * microbatches * parameter_bytes(choice)  # the accumulator, read and written
    return activations + logits + update + collective_buffer_bytes(choice)


def collective_buffer_bytes(choice: Choice) -> float:
    """HBM bytes of the FSDP collectives' buffers in one step: each microbatch's all-gathers
    (forward and backward) write the weights gathered whole, its reduce-scatter reads the whole
    gradient. The compiled programs run them as kernels of their own, outside the matmuls that
    read the gathered weights (docs/plans.md, "The analytic model")."""
    if not _gathered_axes(choice):
        return 0.0
    gathered = _model_gathered_bytes(choice)
    grads = gathered / choice.compute_bytes * choice.param_bytes
    return choice.microbatches * (2 * gathered + grads)


def host_seconds(choice: Choice) -> float:
    """Offloaded activations go to host memory and come back for the backward pass."""
    spec = choice.spec
    host = sum(count * layer_bytes(name, choice, choice.remat)[1]
               for name, count in layer_counts(spec).items())
    return 2 * host * choice.microbatches / host_bandwidth(choice.topology.chip)


def optimizer_host_seconds(choice: Choice) -> float:
    """With AdamW's moments in host memory (Choice.optimizer_on_host), the update brings both in
    and writes them back every step, over the host link: the two directions run at once, one
    array's copy out behind the next one's copy in. Nothing else runs then (the update needs the
    whole gradient for its clipping norm), so the copies are on the critical path. Only the
    moments that go to host are copied: on a TPU, those whose pieces libtpu can lay out there."""
    if not choice.optimizer_on_host:
        return 0.0
    return hosted_moment_bytes(choice) / host_bandwidth(choice.topology.chip)


def step_time(choice: Choice, constants=None) -> StepTime:
    """The formula estimate: the search's fast pre-filter, under the same calibrated constants as
    the compiled program's estimate (mxc.compiler.plan.calibration)."""
    from mxc.compiler.plan.calibration import FITTED

    c = constants or FITTED
    chip = choice.topology.chip
    chips = choice.topology.chips
    tokens = choice.batch * choice.seq
    model_per_token, executed_per_token = executed_flops_per_token(choice, c)
    compute = executed_per_token * tokens / chips / (chip.peak_bf16_flops * c.matmul)
    memory = hbm_traffic(choice) / (chip.hbm_bandwidth * c.hbm)
    comm = {k: v / c.link for k, v in communication(choice).items()}
    offload = host_seconds(choice)
    if offload:
        comm["host offload"] = offload
    moments = optimizer_host_seconds(choice)
    if moments:
        comm["optimizer state over the host link"] = moments  # not overlapped: not named host*
    # Host copies run behind the layers' compute; every collective waits for its result: in each
    # train step XLA compiled for the published rows (docs/plans.md, "Calibration") the FSDP
    # all-gathers and reduce-scatters are synchronous, so each microbatch pays for them again.
    overlapped = sum(v for k, v in comm.items() if k.startswith("host"))
    critical = sum(comm.values()) - overlapped
    busy = compute + memory
    exposed = critical + max(0.0, overlapped - c.overlap * busy)
    step = busy + exposed
    return StepTime(
        compute_s=compute, memory_s=memory, communication_s=sum(comm.values()),
        exposed_communication_s=exposed, step_s=step, tokens_per_s=tokens / step,
        tokens_per_s_per_device=tokens / chips / step,
        mfu=model_per_token * tokens / (step * chips * chip.peak_bf16_flops),
        bubble_fraction=0.0, communication={k: round(v, 6) for k, v in comm.items()})


# ---------------------------------------------------------------- from the compiled program

def device_places(devices) -> list[tuple[int, tuple[int, ...]]]:
    """(slice, physical coordinates) of each position of a program's device assignment."""
    return [(getattr(d, "slice_index", 0) or 0, tuple(getattr(d, "coords", None) or (i,)))
            for i, d in enumerate(devices)]


def collective_seconds(collective, places, chip) -> float:
    """One run of a collective at the links' full bandwidth, by the algorithm XLA uses on a torus:
    rings over each physical dimension the group spans, both directions (an all-gather or
    reduce-scatter moves (m-1)/m of the buffer through them, an all-reduce twice that), then
    the part across slices over DCN; a collective-permute sends its buffer over one link."""
    group = collective.groups[0] if collective.groups else ()
    if len(group) < 2:
        return 0.0
    where = [places[i] for i in group if i < len(places)]
    slices = {s for s, _ in where}
    inside = len(where) // max(1, len(slices))
    one_way_link = chip.ici_bandwidth / max(1, chip.ici_links) / 2
    if collective.kind == "collective-permute":
        crosses = any(places[a][0] != places[b][0] for a, b in collective.groups if max(a, b) < len(places))
        return collective.bytes / (chip.dcn_bandwidth if crosses else one_way_link)
    first_slice = [c for s, c in where if s == where[0][0]]
    spanned = sum(1 for axis in zip(*first_slice) if len(set(axis)) > 1) if len(first_slice) > 1 else 0
    ring = 2 * one_way_link * max(1, spanned)
    seconds = (inside - 1) / inside * collective.bytes / ring if inside > 1 else 0.0
    if len(slices) > 1:
        seconds += (len(slices) - 1) * collective.bytes / len(where) / chip.dcn_bandwidth
    return seconds * (2 if collective.kind == "all-reduce" else 1)


@dataclass(frozen=True)
class ProgramTerms:
    """What the compiled program costs at the datasheet figures, before any constant: the fitted
    constants (mxc.compiler.plan.calibration) turn these into a step time."""

    ops: tuple[tuple[float, float, int], ...]  # (FLOPs, HBM bytes, runs) per kernel
    exposed_collectives_s: float  # synchronous collectives at full link bandwidth
    async_collectives_s: float  # asynchronous ones (FSDP gathers, prefetches)
    host_s: float  # host-offload copies at the host link's bandwidth
    by_kind: dict[str, float]  # collective seconds by kind
    peak_flops: float
    hbm_bandwidth: float
    model_flops: float  # per device and step, MaxText's count
    tokens: float  # per device and step
    devices: int
    stages: int = 1
    microbatches: int = 1

    def to_json(self) -> dict:
        data = asdict(self)
        data["ops"] = [list(op) for op in self.ops]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ProgramTerms":
        return cls(**{**data, "ops": tuple(tuple(op) for op in data["ops"])})


def program_terms(program, places, chip, model_flops: float, tokens: float, extra_flops: float = 0.0,
                  microbatches: int = 1, stages: int = 1) -> ProgramTerms:
    """The compiled program's kernels, collectives and host copies, sized for `chip`.
    `extra_flops` are FLOPs the HLO cannot show (Pallas kernels such as splash attention),
    charged as one compute-bound kernel."""
    exposed = hidden = 0.0
    by_kind: dict[str, float] = {}
    for collective in program.collectives:
        seconds = collective.count * collective_seconds(collective, places, chip)
        by_kind[collective.kind] = by_kind.get(collective.kind, 0.0) + seconds
        if collective.asynchronous:
            hidden += seconds
        else:
            exposed += seconds
    merged: dict[tuple[float, float], int] = {}
    for flops, moved, count in program.ops:
        merged[(flops, moved)] = merged.get((flops, moved), 0) + count
    if extra_flops:
        merged[(extra_flops, 0.0)] = merged.get((extra_flops, 0.0), 0) + 1
    return ProgramTerms(tuple((f, b, n) for (f, b), n in sorted(merged.items())), exposed, hidden,
                        program.host_bytes / host_bandwidth(chip), by_kind, chip.peak_bf16_flops,
                        chip.hbm_bandwidth, model_flops, tokens, len(places), stages, microbatches)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a pipelined step spent idle: (stages - 1) of (microbatches + stages - 1)."""
    return (stages - 1) / (microbatches + stages - 1) if stages > 1 else 0.0


def program_step_time(terms: ProgramTerms, constants=None) -> StepTime:
    """The step time of a compiled program under the calibrated constants."""
    from mxc.compiler.plan.calibration import FITTED

    c = constants or FITTED
    flops_per_s, bytes_per_s = terms.peak_flops * c.matmul, terms.hbm_bandwidth * c.hbm
    compute = memory = 0.0
    for flops, moved, count in terms.ops:
        f, m = flops / flops_per_s, moved / bytes_per_s
        if f >= m:
            compute += count * f
        else:
            memory += count * m
    busy = compute + memory
    exposed = terms.exposed_collectives_s / c.link
    overlappable = terms.async_collectives_s / c.link + terms.host_s
    exposed += max(0.0, overlappable - c.overlap * busy)
    bubble = bubble_fraction(terms.stages, terms.microbatches)
    step = (busy + exposed) / (1 - bubble)
    communication = {k: round(v / c.link, 6) for k, v in terms.by_kind.items()}
    if terms.host_s:
        communication["host offload"] = round(terms.host_s, 6)
    return StepTime(
        compute_s=compute, memory_s=memory, communication_s=sum(communication.values()),
        exposed_communication_s=exposed, step_s=step, tokens_per_s=terms.tokens * terms.devices / step,
        tokens_per_s_per_device=terms.tokens / step, mfu=terms.model_flops / (step * terms.peak_flops),
        bubble_fraction=bubble, communication=communication, source="compiled program")


def program_mfu(terms: ProgramTerms, constants) -> float:
    return program_step_time(terms, constants).mfu
