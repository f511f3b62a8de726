"""Estimated time of one train step: compute, HBM traffic and communication, per device.

    compute        executed FLOPs at the chip's peak: MaxText's training count (6 per weight
                   per token, causal attention counted half) plus the forward matmuls the remat
                   policy makes the backward redo
    memory         bytes that non-matmul work moves through HBM at its bandwidth: every
                   intermediate written and read forward and backward, float32 logits, the
                   AdamW update
    communication  ring collectives, (n-1)/n of the data over the axis's bandwidth (twice for an
                   all-reduce): FSDP's all-gathers of weights and reduce-scatters of gradients,
                   data parallelism's gradient all-reduce, tensor parallelism's activation
                   all-reduces, the experts' all-to-alls, context parallelism's key/value
                   all-gathers

Matmuls are bound by FLOPs and everything else (norms, activations, the loss, the optimizer
update) by HBM bandwidth, so the step adds the two; XLA overlaps FSDP and data-parallel
collectives and host offloading with that work, while tensor, expert and context collectives
sit on the critical path.
An axis inside a slice gets the share of the chip's ICI links that its size spans of the slice
(log2 n of log2 chips); the part of an axis that spans slices runs over DCN.
"""

from __future__ import annotations

import math

from mxc.compiler.analysis import attention_flops_per_token, summarize
from mxc.compiler.kinds import kind_of
from mxc.compiler.plan.activations import RECOMPUTED, layer_bytes, layer_working_bytes
from mxc.compiler.plan.choice import Choice, layer_counts
from mxc.compiler.plan.memory import logits_bytes, parameter_bytes
from mxc.compiler.plan.plan import StepTime
from mxc.spec.ir import MoE

# AdamW's update reads parameter, gradient and both moments and writes three of them back.
UPDATE_ACCESSES = 7
# Host memory behind each chip, per direction: a PCIe 4.0 x16 link (PCI-SIG: 16 GT/s x 16 lanes,
# about 32 GB/s). An assumption about the hosts, not a chip datasheet figure: offloaded
# activations are charged at this rate, overlapped with compute.
HOST_BANDWIDTH = 32e9


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


def executed_flops_per_token(choice: Choice) -> tuple[float, float]:
    """(model FLOPs per token, FLOPs actually executed per token) for training."""
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
        if not choice.attention.startswith("splash"):
            # Without a flash kernel the masked half of the scores is computed too.
            redo += count * core * (1 + ("core" in recomputed) / 3)
        if kind_of(block.mlp).routing(block.mlp) is not None and choice.expert_path == "capacity":
            redo += count * _capacity_overhead_per_token(block.mlp, spec.d_model, choice)
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
    # Norms, activations, RoPE, residual adds: each intermediate written and read forward, its
    # gradient written and read backward; a recomputing backward runs the forward once more.
    passes = 4 + (2 if RECOMPUTED[choice.remat] else 0)
    activations = microbatches * passes * produced
    # Float32 logits written, read by the log-sum-exp, read again for their gradient.
    logits = microbatches * 3 * logits_bytes(choice)
    update = UPDATE_ACCESSES * parameter_bytes(choice)
    if microbatches > 1:
        update += 2 * microbatches * parameter_bytes(choice)  # the accumulator, read and written
    return activations + logits + update


def host_seconds(choice: Choice) -> float:
    """Offloaded activations go to host memory and come back for the backward pass."""
    spec = choice.spec
    host = sum(count * layer_bytes(name, choice, choice.remat)[1]
               for name, count in layer_counts(spec).items())
    return 2 * host * choice.microbatches / HOST_BANDWIDTH


def step_time(choice: Choice) -> StepTime:
    chip = choice.topology.chip
    chips = choice.topology.chips
    tokens = choice.batch * choice.seq
    model_per_token, executed_per_token = executed_flops_per_token(choice)
    compute = executed_per_token * tokens / chips / chip.peak_bf16_flops
    memory = hbm_traffic(choice) / chip.hbm_bandwidth
    comm = communication(choice)
    offload = host_seconds(choice)
    if offload:
        comm["host offload"] = offload
    # XLA runs FSDP's and data parallelism's collectives and the host copies asynchronously,
    # behind the layers' compute; the rest waits for its result.
    overlapped = sum(v for k, v in comm.items() if k.startswith(("fsdp", "data", "host")))
    critical = sum(comm.values()) - overlapped
    busy = compute + memory
    exposed = critical + max(0.0, overlapped - busy)
    step = busy + exposed
    return StepTime(
        compute_s=compute, memory_s=memory, communication_s=sum(comm.values()),
        exposed_communication_s=exposed, step_s=step, tokens_per_s=tokens / step,
        mfu=model_per_token * tokens / (step * chips * chip.peak_bf16_flops),
        communication={k: round(v, 6) for k, v in comm.items()})
