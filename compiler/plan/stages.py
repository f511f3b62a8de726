"""Pipeline stages in the planner: which stage counts a search tries, the pipeline a plan with
stages records, and what stages change in the predicted memory and the formula's step time.

The lowering (compiler/lower/pipeline.py) pipelines the model's largest segment of layers over
the `stage` mesh axis, every microbatch of the plan going through it (no gradient accumulation
beside it), one repeat, so each stage holds a contiguous block of the flat layer order and the
parameters are split over stages by `layers -> stage` with no data moved.

Memory with stages. The pipeline's scan rematerialises each iteration under the plan's policy, so
what it keeps for the backward pass is, per iteration (microbatches + stages - 1 of them): its
carried activations (one microbatch per stage in flight, and the buffer of every microbatch's
activation, which is not split over stages) and what the policy keeps inside the iteration's
layers per stage; the backward then recomputes one iteration at a time, holding every
intermediate of the stage's layers. Layer weights, their gradients and the optimizer state are
divided by the stages through the rule; there is no gradient accumulator.

Time with stages. The formula charges the work of the whole step spread over all devices, which
a pipeline reaches only outside its bubble: the step is divided by (1 - bubble); each iteration
sends one microbatch's activation to the next stage forward and its gradient back (and again
where the backward recomputes). A compiled program runs its bubble iterations (the stages
compute and throw away), so its estimate already holds the bubble and only reports it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from mxc.compiler.plan.plan import STAGE_AXIS, Memory, Pipeline, StepTime

# Stage counts a search tries without a pin: a pipeline over the slices' data-centre network, and
# 2 or 4 stages for models this large (parameters), where a layer's weights gathered over a
# large FSDP axis dominate.
LARGE_MODEL_PARAMETERS = 150e9
STAGES_FOR_LARGE_MODELS = (2, 4)


def pipelined_layers(spec) -> tuple[int, int]:
    """(index of the segment the lowering pipelines, its layer count)."""
    from mxc.compiler.lower.pipeline import pipelined_segment_index

    index = pipelined_segment_index(spec)
    return index, spec.layers[index].repeat


def stage_counts(spec, topology, pins: Mapping[str, int]) -> list[int]:
    """The stage counts a search considers: the pin, or 1 and the counts worth trying."""
    from mxc.compiler.analysis import summarize

    if STAGE_AXIS in pins:
        return [pins[STAGE_AXIS]]
    _, layers = pipelined_layers(spec)
    counts = {1}
    if topology.slices > 1:
        counts.add(topology.slices)
    if summarize(spec, spec.max_seq).total_params >= LARGE_MODEL_PARAMETERS:
        counts.update(STAGES_FOR_LARGE_MODELS)
    return sorted(s for s in counts if topology.chips % s == 0 and layers >= s)


def pipeline_for(spec, stages: int, microbatches: int, repeats: int = 1) -> Pipeline | None:
    """The pipeline a plan with `stages` records (None for one stage)."""
    from mxc.compiler.lower.pipeline import PipelineLayout

    if stages == 1:
        return None
    segment, layers = pipelined_layers(spec)
    layout = PipelineLayout(stages, microbatches, repeats)
    return Pipeline(stages=stages, microbatches=microbatches, repeats=repeats, segment=segment,
                    layers=layout.pipelined(layers), bubble_fraction=round(layout.bubble_fraction, 6))


def valid(spec, stages: int, microbatches: int) -> bool:
    """Whether the lowering can pipeline this (every stage gets a layer)."""
    return stages == 1 or pipelined_layers(spec)[1] >= stages


def with_stage_rules(rules: dict, mesh: Mapping[str, int], tensors) -> dict:
    """The rules with layer stacks split over the stage axis, where every stack divides evenly
    (a stack with layers left over after the pipelined ones stays whole on every stage)."""
    stages = mesh.get(STAGE_AXIS, 1)
    stacks = [t.shape[t.axes.index("layers")] for t in tensors if "layers" in t.axes]
    if stages == 1 or any(n % stages for n in stacks):
        return rules
    return {**rules, "layers": (STAGE_AXIS,)}


def stages_of(choice) -> int:
    return choice.mesh.get(STAGE_AXIS, 1)


def _residual_bytes(choice) -> int:
    """One microbatch's residual stream on one device."""
    return choice.local((choice.microbatch, choice.seq, choice.spec.d_model),
                        ("batch", "residual_seq", "embed")) * choice.compute_bytes


def adjust_memory(choice, predicted: Memory) -> Memory:
    """memory.predict's figures for a plan with stages (module docstring)."""
    from mxc.compiler.plan.activations import layer_bytes, layer_working_bytes
    from mxc.compiler.plan.choice import layer_counts

    stages = stages_of(choice)
    if stages == 1:
        return predicted
    spec = choice.spec
    microbatches = choice.microbatches
    iterations = microbatches + stages - 1
    residual = _residual_bytes(choice)
    counts = layer_counts(spec)
    per_stage = {name: -(-count // stages) for name, count in counts.items()}
    inside = sum(n * max(0, layer_bytes(name, choice, choice.remat)[0] - residual) for name, n in per_stage.items())
    if choice.remat == "full":
        inside = 0
    carried = (1 + microbatches) * residual
    recomputed = sum(n * layer_working_bytes(name, choice) for name, n in per_stage.items())
    return predicted.model_copy(update={
        "activations": int(iterations * (carried + inside)),
        "temporaries": int(max(predicted.temporaries, recomputed)),
        "gradients": predicted.parameters,
    })


def _gathered_shares(choice, pipeline: Pipeline) -> tuple[float, float, float]:
    """The bytes cost.communication gathers over FSDP per microbatch, split into (the pipelined
    layers, the pipelined segment's layers left after them, everything else)."""
    prefix = f"segments/{pipeline.segment}/"
    piped = left = other = 0.0
    for t in choice.params.tensors:
        whole = choice.local(t.shape, t.axes) * choice.gather_factor(t.axes)
        if t.path.startswith(prefix) and "layers" in t.axes:
            stack = t.shape[t.axes.index("layers")]
            piped += whole * pipeline.layers / stack
            left += whole * (stack - pipeline.layers) / stack
        else:
            other += whole
    return piped, left, other


# Collectives cost.communication charges per layer a device runs, for every layer of the model.
PER_LAYER_COLLECTIVES = ("tensor all-reduce", "expert all-to-all", "context all-gather")
FSDP_COLLECTIVES = ("fsdp all-gather", "fsdp reduce-scatter")


def _stage_communication(choice, time: StepTime, pipeline: Pipeline) -> dict[str, float]:
    """cost.communication's terms as a device with stages pays them outside the bubble. The
    formula charges every device the collectives of every layer for every microbatch; a stage
    runs only its share of the pipelined layers: its FSDP gathers and reduce-scatters move its
    layers' weights (per microbatch pass, 1/stages of them) and the layers left after the
    pipeline (per microbatch), the other weights (embedding, head, other segments) once a step
    (no gradient accumulation beside the pipeline), and the per-layer activation collectives
    shrink the same way. The bubble is charged separately (the step divided by 1 - bubble)."""
    microbatches, stages = choice.microbatches, pipeline.stages
    piped, left, other = _gathered_shares(choice, pipeline)
    whole = microbatches * (piped + left + other)
    fsdp = (microbatches * (piped / stages + left) + other) / whole if whole else 1.0
    blocks = len(choice.spec.layers[pipeline.segment].period) * pipeline.layers
    layers = choice.spec.num_layers
    per_layer = (blocks / stages + layers - blocks) / layers
    return {k: v * fsdp if k in FSDP_COLLECTIVES else v * per_layer if k in PER_LAYER_COLLECTIVES else v
            for k, v in time.communication.items()}


def adjust_time(choice, time: StepTime) -> StepTime:
    """cost.step_time's estimate for a plan with stages (module docstring)."""
    from mxc.compiler.plan.activations import RECOMPUTED
    from mxc.compiler.plan.calibration import FITTED
    from mxc.compiler.plan.cost import ring_seconds

    stages = stages_of(choice)
    if stages == 1:
        return time
    layout = pipeline_for(choice.spec, stages, choice.microbatches)
    communication = _stage_communication(choice, time, layout)
    saved = sum(time.communication.values()) - sum(communication.values())  # all on the critical path
    iterations = choice.microbatches + stages - 1
    passes = 3 if RECOMPUTED[choice.remat] else 2
    # A collective-permute over the stage axis moves one buffer over one hop: a ring pass over two.
    hop = ring_seconds(replace(choice, mesh={**choice.mesh, STAGE_AXIS: 2},
                               dcn={**choice.dcn, STAGE_AXIS: 2} if choice.dcn.get(STAGE_AXIS, 1) > 1 else choice.dcn),
                       (STAGE_AXIS,), 2 * _residual_bytes(choice))
    permute = passes * iterations * hop / FITTED.link
    step = (time.step_s - saved + permute) / (1 - layout.bubble_fraction)
    scale = time.step_s / step
    return time.model_copy(update={
        "communication_s": time.communication_s - saved + permute,
        "exposed_communication_s": time.exposed_communication_s - saved + permute,
        "communication": {**{k: round(v, 6) for k, v in communication.items()},
                          "stage collective-permute": round(permute, 6)},
        "step_s": step, "tokens_per_s": time.tokens_per_s * scale,
        "tokens_per_s_per_device": time.tokens_per_s_per_device * scale, "mfu": time.mfu * scale,
        "bubble_fraction": layout.bubble_fraction})


def reported(plan_pipeline: Pipeline | None, time: StepTime | None) -> StepTime | None:
    """A compiled program's estimate with the pipeline's bubble shown (already in its time)."""
    if time is None or plan_pipeline is None:
        return time
    return time.model_copy(update={"bubble_fraction": plan_pipeline.bubble_fraction})



def stage_policy(policy: str, mesh: Mapping[str, int]) -> bool:
    """Whether a remat policy is a candidate on this mesh: the pipeline rematerialises whole
    iterations on device, so plans with stages offload nothing to host."""
    from mxc.compiler.lower.remat import needs_host_memory

    return mesh.get(STAGE_AXIS, 1) == 1 or not needs_host_memory(policy)


def stage_reasons(chosen) -> list[str]:
    """What `mxc plan --explain` says about the chosen plan's pipeline."""
    stages = stages_of(chosen.choice)
    if stages == 1:
        return []
    pipeline = pipeline_for(chosen.choice.spec, stages, chosen.choice.microbatches)
    return [f"pipeline: {stages} stages over segment {pipeline.segment} ({pipeline.layers} layers), "
            f"{pipeline.microbatches} microbatches; the bubble idles {pipeline.bubble_fraction:.1%} of the "
            f"step ((stages - 1) of microbatches + stages - 1 iterations), charged in the step time"]
