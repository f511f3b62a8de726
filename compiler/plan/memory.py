"""Analytic per-device memory of a train step (and of a serving KV cache).

    parameters       every parameter's shard, counted tensor by tensor under the rules
    optimizer state  AdamW's two moments, laid out and typed like the parameters; in host memory
                     where the plan keeps them there (Choice.optimizer_on_host; on a TPU those
                     libtpu lays out there, hosted_moment_bytes), HBM holding a layer's at a
                     time during the update (MOMENTS_IN_HBM_WHEN_ON_HOST)
    gradients        one parameter-sized buffer (the scan writes every layer's gradient into
                     it); a second one accumulates across microbatches
    activations      what each layer keeps for the backward pass under the remat policy, for
                     one microbatch, times the layers (offloaded names live in host memory)
    temporaries      the larger of the loss's (float32 logits of one microbatch and the output
                     head's float32 weight gradient) and one layer's backward (part of its intermediates, its
                     weights gathered whole, their gradient before the reduce-scatter; where
                     activations are offloaded, the copies in flight and an untied head's
                     logits); near the HBM limit, what XLA squeezes them to where their
                     irreducible part fits

The factors below that are not plain counting were measured against XLA's memory analysis of
mxc's own train step compiled for TPU targets (docs/plans.md lists the runs).
"""

from __future__ import annotations

from mxc.compiler.kinds import kind_of
from mxc.compiler.plan.activations import (attention_score_bytes, dispatch_bytes, dispatch_held_bytes,
                                          intermediate_bytes, kept_names, layer_bytes, layer_working_bytes,
                                          megablox_region, vision_bytes)
from mxc.compiler.plan.choice import Choice, layer_counts
from mxc.compiler.plan.plan import Memory
from mxc.compiler.plan.stages import adjust_memory

ADAM_MOMENTS = 2

# Measured against XLA's memory analysis and buffer assignment of mxc's train step for TPU
# targets (Llama 3.1 8B on v6e-256 at 1 and 4 sequences per device, remat full, minimal and
# save_qkv_offloaded; Llama 3.1 70B on v6e-256; small Llamas on v5e-8). The peak comes at one of
# two moments, on top of the state, the gradients and the scanned stack of saved activations:
#   the loss: the float32 logits of one microbatch (their gradient is fused into the head's two
#   backward matmuls and never materialised), and the output head's weight gradient whole before
#   its reduction, in float32 and in the bfloat16 copy the reduction takes, beside the head's
#   bfloat16 weight gathered whole (2 of that gradient's float32 size). Llama 3.1 8B on v6e-256,
#   fsdp 256, full remat, 2 sequences a device, in XLA's buffer assignment at the loss: f32 logits
#   8016 MiB, the head's gradient f32 2004 and bf16 1002 (all-reduced whole), its gathered weight
#   1002, the final hidden state in f32 256 (not counted), beside the 4096 MiB stack of layer
#   inputs; XLA 16.52 GiB in all, predicted 16.21 (0.981; 17.03, 1.031, with the loops' rule
#   below). On small Llamas on v5e-8 (fsdp 8) XLA reduce-scatters the float32 gradient itself, and
#   the bfloat16 copy is not there: the 8-layer stand-in of tests/test_memory_levers.py (2 x 4096
#   tokens a device) holds f32 logits 1000 MiB, the head's f32 gradient 250 and its weight 125; the
#   two-layer one of tests/test_plan.py (8 x 1024 tokens) the logits' 256 MiB beside the saved
#   stack, its 16 MiB gradient in the TensorCore's own memory. Predicted/XLA: the two-layer Llama
#   1.057 (XLA 499 MiB); the 8-layer stand-in 1.062 (2566 MiB) and at 4 x 4096 tokens 1.016 (3919
#   MiB; the loops' rule 1.279, 1.132, 1.190);
#   a layer's backward: part of that layer's intermediates, and three copies of its weights
#   gathered whole (the one in use, the next one prefetched, its gradient before the
#   reduce-scatter).
# Where XLA's collective-matmul loops stay on (xla_options.collective_matmul_loops: a mesh with a
# tensor axis), the loss keeps the rule measured on such programs: 1.5 logits (the logits and their
# bfloat16 gradient) and two layers' weights gathered (the two-layer Llama compiled with the loops
# at fsdp 8, before mxc turned them off there: XLA 663 MiB, predicted 638 this way and 526 the
# loop-free way; Llama 3.1 8B on v6e-256, fsdp 64 x tensor 4, 16 sequences a device: temporaries
# 56.59 GiB, predicted 55.80). XLA makes the loops above a size threshold only; the 8-layer
# stand-in at fsdp 2 x tensor 4 has none, and its loss holds, beside the logits, the head's
# float32 input gradient before the all-reduce over tensor (XLA 3408 MiB, predicted 3539 this way,
# 1.039; 3119, 0.915, the loop-free way). Llama 3.1 8B on v6e-256, full remat, with one sequence
# a device: XLA 10.36 GiB, predicted 10.30 (0.994; 9.15, 0.883, with the loops' rule); with 4
# sequences a device XLA 27.92 GiB, predicted 28.04 (1.004; the loops' rule asked 32.8, which only
# the squeeze near the HBM limit below brought to 28.1).
LOGITS_BUFFERS = 1.0
HEAD_GRADIENT_BUFFERS = 2
LOGITS_BUFFERS_WITH_LOOPS = 1.5
GATHERED_AT_LOSS = 2
LAYER_WORKING_SET = 0.4
GATHERED_LAYERS = 3
# The XLA attention path (no flash kernel) holds float32 buffers of a layer's scores' size while it
# differentiates the softmax (the scores, the probabilities, their gradients): four at once at the
# peak of Gemma 3 27B's text backward on v5p-256 (one 4096-token sequence per device, 2 GiB each in
# XLA's buffer assignment; counting two predicted 0.79 of XLA's total, docs/multimodal.md).
ATTENTION_SCORE_BUFFERS = 4
# A tied table's head gradient is added to its lookup's, which comes last in the text backward:
# XLA forms it there and keeps the microbatch's float32 logits from the loss through every text
# layer's backward (Gemma 3 27B on v5p-256: 4 GiB live until after the last layer's backward).
TIED_HEAD_LOGITS = 1
# The dropless expert dispatch's buffers are all live in a layer's backward (recomputed gate, up
# and hidden units beside their gradients): Mixtral 8x7B on v5p-256, fsdp 64 x expert 2,
# minimal_with_context, one microbatch: XLA 65.86 GiB; with the dense layers' 0.4 share the
# prediction was 54.5 GiB (0.83), with all of them 1.0 (docs/plans.md).
DISPATCH_WORKING_SET = 1.0
# Where a layer's dropless experts run megablox in a region manual over every mesh axis
# (activations.megablox_region), their weights enter the region as their stored shards and are
# gathered inside in the compute dtype (compiler/lower/moe.py): XLA holds them once through the
# layer's backward (its recomputation, the input gradients, then the weight gradients), none
# prefetched beside another layer's, and each weight's gradient leaves as a bfloat16
# reduce-scatter, one at a time: its product and the relayout copy the collective takes, beside
# the weights not yet differentiated. XLA's buffer assignment of DeepSeek V3's MoE layer backward
# (v5p-1024, fsdp 512): the three [256, 7168, 2048] bf16 weights, 7 GiB each, from the layer's
# recomputation to their gradients, 28 GiB at most (two weights, the third's gradient and its
# copy), where three gathered copies of the layer counted 64.3 GiB. So such a layer's experts
# count once, and the largest of them once more.
EXPERT_GRADIENTS_IN_FLIGHT = 1
# Under sequence parallelism a layer's backward also holds values whole over the sequence that the
# split residual stream does not show: the gathered normed input and the output projections'
# incoming gradient, gathered, and the normed input's gradient before its reduce-scatter. XLA's
# buffer assignment at the layer backward of MaxText's 32B layer on v5p-128 (fsdp 16 x tensor 4,
# minimal, 4-layer stand-ins, parallel and sequential blocks alike): four bf16[32,2048,10240],
# 1280 MiB each, beside the layer's other values; without them the stand-ins read 0.740 (parallel)
# and 0.658 (sequential), the full 32-layer model 0.940.
SEQUENCE_PARALLEL_WHOLE_RESIDUALS = 4
# In a plan that offloads activations, an untied head's weight gradient comes after the layers'
# backward too: XLA's buffer assignment keeps the float32 logits from the loss to past the backward
# loop (Llama 3.1 405B on v5p-1024, fsdp 512, layer input offloaded, 7.83 GiB; Llama 3.1 8B on
# v6e-256, fsdp 256, qkv_proj_offloaded, 2 microbatches, 7.83 GiB). Without offloading it forms
# it before (Llama 3.1 8B on v6e-256, full and minimal remat, one microbatch; Llama 2 70B on
# v5p-512, minimal_with_context, 4 microbatches), and near the HBM limit too: Llama 3.1 405B on
# 2 x v6e-256, fsdp 512, layer input offloaded, moments on host, XLA 27.19 GiB of 31.24 (predicted
# 30.99 holding them, 27.08 not), and Llama 3.1 70B on v6e-256, qkv_proj_offloaded, 5 microbatches,
# 28.45 GiB, which this model still counts as holding them (28.00 predicted, just under the line;
# see the copies in flight below). So a plan that holds them above SQUEEZED_SHARE of HBM is
# predicted without them (`squeezed`), and they are not part of what XLA cannot squeeze. None
# where the loss runs over pieces (docs/plans.md, "The largest models").
UNTIED_HEAD_LOGITS = 1
# Offloaded activations also take device memory while their copies to and from the host are in
# flight. The layer input goes as one copy per layer, and XLA holds one layer's at a time (Llama
# 3.1 405B on v5p-1024, fsdp 512: one 512 MiB transfer each way in XLA's transfer_stats; with the
# logits above, predicted/XLA 1.008; a third of the 63 GiB offloaded, the rule before, gave 1.309).
# The names a layer computes (q/k/v, out_proj, context) are copied while it runs: a share of them,
# set by MaxText's one-microbatch offloading settings on v6e-256 (tests/test_memory_levers.py): from
# 0.13 Llama 3.1 405B's (2 slices) and from 0.22 Mixtral 8x7B's ask more than the room beside
# their state, as XLA's squeezed totals say they do; up to 0.24 Llama 3.1 8B's stays at its loss
# peak (24.76 GiB, XLA 23.99). Llama 3.1 70B on v6e-256 with qkv_proj_offloaded and 5 microbatches
# is predicted 27.99 GiB at 0.24 against XLA's 28.45, but XLA's peak there is the forward's end,
# with two copies of the 10 GiB stack of layer inputs (not modelled), not copies in flight.
LAYER_INPUT_COPIES_IN_FLIGHT = 1
OFFLOAD_STAGING = 0.24
# Near the HBM limit XLA rematerialises and schedules the host copies to fit: a plan whose
# prediction is over what HBM leaves for temporaries, but whose irreducible part (the loss's
# float32 logits once, the layers' working set, nothing in flight to the host) fits, compiles at
# about this share of HBM. Measured (XLA's total of 31.24 GiB on v6e): Llama 3.1 70B with 5
# sequences per device and 112.5 GiB offloaded, 29.97 GiB (0.96; predicted without this 52.2);
# Llama 3.1 405B on 2 x v6e-256, 98.4 GiB offloaded, 30.14 (0.96; 51.3); Mixtral 8x7B, 42 GiB
# offloaded, 29.1 (0.93; 32.7). (Llama 3.1 8B, full remat, 4 sequences per device, 27.92, was
# counted here while the loss was charged 1.5 logits; it is now predicted unsqueezed, 28.04.)
# Where the irreducible part does not fit, XLA reports the unsqueezed need (Llama 3.1 8B,
# fsdp 64 x tensor 4, 16 sequences: temporaries 56.59 GiB, predicted 55.80).
SQUEEZED_SHARE = 0.9
LOGITS_IRREDUCIBLE = 1.0

# Host memory of one TPU VM per chip (Google Cloud machine types: ct5lp-hightpu-8t 384 GB for 8
# v5e chips, ct5p-hightpu-4t 448 GB for 4 v5p chips, ct6e-standard-8t 1440 GB for 8 v6e chips);
# offloaded activations may take 0.7 of it, the rest is the runtime's and the input pipeline's
# (MaxText's Llama 3.1 70B setting on v6e-256 runs with 112.5 GiB per chip offloaded, 0.67; XLA
# itself refuses more than 128 GiB per device).
HOST_MEMORY_PER_CHIP = {"v5e": 384e9 / 8, "v5p": 448e9 / 4, "v6e": 1440e9 / 8}
HOST_SHARE_FOR_ACTIVATIONS = 0.7


def host_budget(choice: Choice) -> float:
    """Bytes of offloaded activations one device may keep in host memory."""
    return HOST_SHARE_FOR_ACTIVATIONS * HOST_MEMORY_PER_CHIP.get(choice.topology.chip.name, 0.0)


# Where a plan keeps AdamW's moments in host memory (Choice.optimizer_on_host), the update brings
# them to HBM a layer at a time (train.layered_optimizer); this share of them is in HBM at its
# peak, measured on a 4-layer Llama 3.1 8B on v6e-8 (fsdp 8, full remat, one 2048-token sequence
# per device, 1.79 GiB of moments): XLA's device peak 6.06 GiB with the moments in HBM, 4.54 GiB
# with them on host. The full model there saves 55% of its 7.48 GiB, not 85%: the loop writes the
# stacked layers' updates whole, which this share leaves out (docs/plans.md, "Optimizer state on
# host"). The updated layers' moments go to a second host buffer: the host holds them twice.
MOMENTS_IN_HBM_WHEN_ON_HOST = 0.15
MOMENT_COPIES_ON_HOST = 2


def optimizer_state_bytes(choice: Choice) -> int:
    """AdamW's moments on one device, wherever they live."""
    return ADAM_MOMENTS * parameter_bytes(choice)


def hosted_moment_bytes(choice: Choice) -> int:
    """The moments a plan with them on host (Choice.optimizer_on_host) keeps there, on one device:
    on a TPU, those of the parameters whose per-device pieces libtpu lays out in host memory
    (optimizer.host_tiles_accept, as train.train_state_shardings places them); the rest stay in HBM."""
    from mxc.compiler.lower.optimizer import host_tiles_accept

    if choice.topology.platform != "tpu":
        return optimizer_state_bytes(choice)
    return choice.memo("hosted_moment_bytes", lambda: ADAM_MOMENTS * choice.param_bytes * sum(
        choice.local(t.shape, t.axes) for t in choice.params.tensors
        if host_tiles_accept(tuple(-(-dim // count) for dim, count in zip(t.shape, choice.counts(t.axes))),
                             t.axes[:1] == ("layers",))))


def parameter_bytes(choice: Choice) -> int:
    return choice.memo("parameter_bytes", lambda: sum(choice.local(t.shape, t.axes) for t in choice.params.tensors)
                       * choice.param_bytes)


def logits_bytes(choice: Choice) -> int:
    """The float32 logits of one microbatch on one device."""
    spec = choice.spec
    return choice.local((choice.microbatch, choice.seq, spec.vocab), ("batch", "seq", "vocab")) * 4


def loss_logits_bytes(choice: Choice) -> int:
    """The float32 logits alive at once in the loss: one microbatch's, or one of its pieces' where
    the loss runs over pieces of the sequence (Choice.loss_chunks; each piece's logits are
    recomputed in the backward pass and none is kept through it)."""
    return logits_bytes(choice) // choice.loss_chunks


def head_gradient_bytes(choice: Choice) -> int:
    """The output head's float32 weight gradient at the loss, whole but for the vocabulary's split:
    formed before its reduce-scatter (where the loss runs over pieces, summed over them as the
    loop's carry)."""
    spec = choice.spec
    return -(-spec.vocab // choice.split("vocab")) * spec.d_model * 4


def loss_peak_bytes(choice: Choice) -> float:
    """The temporaries at the loss (the module's comments above LOGITS_BUFFERS): with XLA's
    collective-matmul loops in the program, 1.5 logits and two layers' weights gathered (and the
    head's gradient where the loss runs over pieces); without, the logits and the head's gradient
    beside its gathered weight."""
    from mxc.compiler.xla_options import collective_matmul_loops

    logits = loss_logits_bytes(choice)
    if collective_matmul_loops(choice.topology.platform, choice.mesh):
        chunked = head_gradient_bytes(choice) if choice.loss_chunks > 1 else 0
        return LOGITS_BUFFERS_WITH_LOOPS * logits + GATHERED_AT_LOSS * one_gathered_layer_bytes(choice) + chunked
    return LOGITS_BUFFERS * logits + HEAD_GRADIENT_BUFFERS * head_gradient_bytes(choice)


def one_gathered_layer_bytes(choice: Choice) -> int:
    """One copy of the largest layer's weights in the compute dtype, gathered over the axes that
    only split them for memory (tensor and expert shards stay split); backward_gathered_bytes
    counts the copies a layer's backward holds."""
    return choice.memo("one_gathered_layer_bytes", lambda: _one_gathered_layer_bytes(choice))


def _one_gathered_layer_bytes(choice: Choice) -> int:
    return max((sum(parts[:2]) for parts in gathered_parts(choice).values()), default=0)


def gathered_parts(choice: Choice) -> dict[tuple[str, str], tuple[int, int, int]]:
    """Each layer kind's weights gathered as one_gathered_layer_bytes counts them, by (kind, position
    in its segment): (the weights but the routed experts', the routed experts', the largest of
    the routed experts' tensors)."""
    return choice.memo("gathered_parts", lambda: _gathered_parts(choice))


def _gathered_parts(choice: Choice) -> dict[tuple[str, str], tuple[int, int, int]]:
    per_kind: dict[tuple[str, str], list[int]] = {}
    for tensor in choice.params.tensors:
        if not tensor.path.startswith("segments/") or tensor.axes[:1] != ("layers",):
            continue
        segment, position = tensor.path.split("/")[1:3]
        local = choice.local(tensor.shape, tensor.axes) * choice.gather_factor(tensor.axes)
        size = local // tensor.shape[0] * choice.compute_bytes
        parts = per_kind.setdefault((segment, position), [0, 0, 0])
        if "/mlp/experts/" in tensor.path:
            parts[1] += size
            parts[2] = max(parts[2], size)
        else:
            parts[0] += size
    return {key: tuple(parts) for key, parts in per_kind.items()}


def _block_names(choice: Choice) -> dict[tuple[str, str], str]:
    """The block kind at each (segment, position in its period) of the parameters' paths."""
    return {(str(s), str(p)): name for s, segment in enumerate(choice.spec.layers)
            for p, name in enumerate(segment.period)}


def backward_gathered_bytes(choice: Choice) -> int:
    """The weights gathered whole at a layer's backward, the largest layer's: GATHERED_LAYERS
    copies (the one in use, the next one prefetched, its gradient before the reduce-scatter), but
    routed experts gathered inside megablox's region once, with one of them in flight to its
    reduce-scatter (EXPERT_GRADIENTS_IN_FLIGHT)."""
    # megablox_region reads the expert path (in the shapes' key) and the platform
    return choice.memo(f"backward_gathered_bytes/{choice.topology.platform}", lambda: _backward_gathered_bytes(choice),
                       shapes=True)


def _backward_gathered_bytes(choice: Choice) -> int:
    block_of = _block_names(choice)
    best = 0
    for key, (dense, experts, largest) in gathered_parts(choice).items():
        if experts and megablox_region(block_of[key], choice):
            best = max(best, GATHERED_LAYERS * dense + experts + EXPERT_GRADIENTS_IN_FLIGHT * largest)
        else:
            best = max(best, GATHERED_LAYERS * (dense + experts))
    return best


def predict(choice: Choice) -> Memory:
    return predict_squeezed(choice)[0]


def predict_squeezed(choice: Choice) -> tuple[Memory, float | None]:
    """(predict's Memory, and where it squeezes the plan's temporaries to fit (`squeezed`: XLA
    rematerialises near the HBM limit) their irreducible part, which the prediction rests on
    fitting; None where they are predicted as asked)."""
    spec = choice.spec
    parameters = parameter_bytes(choice)
    device = host = 0
    kinds = layer_counts(spec)
    for name, count in kinds.items():
        kept, offloaded = layer_bytes(name, choice, choice.remat)
        device += count * kept
        host += count * offloaded
    # A vision tower's encoder runs first and keeps its layers' activations until its backward.
    device += vision_bytes(choice)[0]
    temporaries, irreducible, unheld = temporaries_parts(choice, host)
    gradients = parameters * (2 if choice.microbatches > 1 else 1)
    moments = optimizer_state_bytes(choice)
    hosted = hosted_moment_bytes(choice) if choice.optimizer_on_host else 0
    moments_on_device = moments - hosted + int(MOMENTS_IN_HBM_WHEN_ON_HOST * hosted)
    squeezed_from = None
    if choice.mesh.get("stage", 1) == 1:  # stages.adjust_memory has its own temporaries
        beside = parameters + moments_on_device + gradients + device
        temporaries, squeezed_from = _squeeze(temporaries, irreducible, choice.topology.usable_hbm_bytes, beside,
                                              unheld)
    return adjust_memory(choice, Memory(
        parameters=parameters,
        optimizer_state=moments_on_device,
        gradients=gradients,
        activations=device,
        temporaries=int(temporaries),
        host=host + MOMENT_COPIES_ON_HOST * hosted,
    )), squeezed_from


def temporaries_parts(choice: Choice, host: float) -> tuple[float, float, float]:
    """(the temporaries XLA asks for with `host` bytes of activations offloaded, their irreducible
    part: what it squeezes them to near the HBM limit, at least; the temporaries asked where XLA
    does not hold an untied head's logits through the layers' backward)."""
    spec = choice.spec
    kinds = layer_counts(spec)
    layer_working = max(LAYER_WORKING_SET * (layer_working_bytes(name, choice) - dispatch_bytes(name, choice))
                  + (ATTENTION_SCORE_BUFFERS - LAYER_WORKING_SET) * attention_score_bytes(name, choice)
                  + DISPATCH_WORKING_SET * dispatch_held_bytes(name, choice)
                  for name in kinds)
    # One of a vision tower's layers' backward is another candidate for the largest working set.
    layer_working = max(layer_working, vision_bytes(choice)[1])
    gathered = one_gathered_layer_bytes(choice)
    loss_peak = loss_peak_bytes(choice)
    layer_peak = layer_working + backward_gathered_bytes(choice) + whole_residual_bytes(choice)
    held_logits = 0
    if spec.embedding.tied:
        layer_peak += TIED_HEAD_LOGITS * loss_logits_bytes(choice)
    elif host and choice.loss_chunks == 1:
        held_logits = UNTIED_HEAD_LOGITS * logits_bytes(choice)
    # Copies to and from the host are in flight while layers run, not at the loss, where the
    # forward's have landed and the backward's have not started (Llama 3.1 70B on v6e-256 with
    # each layer's input and q/k/v offloaded, 112 GiB to host, one microbatch: XLA's device
    # temporaries 26.9 GiB, below the loss peak alone).
    layers = layer_peak + offload_staging_bytes(choice, host)
    irreducible = max(LOGITS_IRREDUCIBLE * loss_logits_bytes(choice) + GATHERED_AT_LOSS * gathered, layer_peak)
    return max(loss_peak, layers + held_logits), irreducible, max(loss_peak, layers)


def whole_residual_bytes(choice: Choice) -> int:
    """What a layer's backward holds whole over the sequence under sequence parallelism
    (SEQUENCE_PARALLEL_WHOLE_RESIDUALS residual-shaped values, gathered like a parallel block's
    normed input); 0 where the residual stream is not split over tensor."""
    from mxc.compiler.lower.block import GATHERED_AXES
    from mxc.compiler.plan.rules import sequence_parallel

    if not sequence_parallel(choice.rules):
        return 0
    whole = choice.local((choice.microbatch, choice.seq, choice.spec.d_model), GATHERED_AXES)
    return SEQUENCE_PARALLEL_WHOLE_RESIDUALS * whole * choice.compute_bytes


def offload_staging_bytes(choice: Choice, host: float) -> float:
    """Device bytes of the copies to and from the host in flight while a layer runs, `host` bytes
    of activations offloaded in all: one layer's input where the policy offloads it, and a share
    of the rest."""
    if "layer_input" not in kept_names(choice.remat)[1]:
        return OFFLOAD_STAGING * host
    kinds = layer_counts(choice.spec)
    inputs = {name: intermediate_bytes(name, choice).get("layer_input", 0) for name in kinds}
    rest = host - sum(count * inputs[name] for name, count in kinds.items())
    return LAYER_INPUT_COPIES_IN_FLIGHT * max(inputs.values()) + OFFLOAD_STAGING * rest


def squeezed(temporaries: float, irreducible: float, hbm: float, beside: float,
             unheld: float | None = None) -> float:
    """The temporaries XLA ends with on `hbm` bytes, `beside` of them taken by the state and the
    kept activations: all it asks for where that fits (`unheld`, without an untied head's logits
    held through the layers' backward, where that puts the plan above SQUEEZED_SHARE of HBM);
    where only the irreducible part fits, what it squeezes to (the plan at SQUEEZED_SHARE of HBM,
    at least the irreducible part); where not even that fits, all it asks for (XLA's refusal
    reports the unsqueezed need)."""
    return _squeeze(temporaries, irreducible, hbm, beside, unheld)[0]


def _squeeze(temporaries: float, irreducible: float, hbm: float, beside: float,
             unheld: float | None = None) -> tuple[float, float | None]:
    """(squeezed's temporaries, `irreducible` where they are squeezed to fit, else None)."""
    room = hbm - beside
    if temporaries <= room and unheld is not None and beside + temporaries > SQUEEZED_SHARE * hbm:
        return unheld, None
    if temporaries <= room or irreducible > room:
        return temporaries, None
    return max(irreducible, SQUEEZED_SHARE * hbm - beside), irreducible


def kv_cache_bytes(choice: Choice, cache_seq: int, batch: int | None = None) -> int:
    """One device's KV cache for serving `batch` sequences of up to `cache_seq` tokens: keys and
    values of every layer in the compute dtype, split like the activations (batch over the
    batch axes, kv heads over tensor)."""
    spec = choice.spec
    batch = choice.batch if batch is None else batch
    total = 0
    for name in spec.layer_kinds:
        att = spec.blocks[name].attention
        # The lowering keeps a full-length cache on sliding-window layers too (the mask applies
        # the window); each kind states its entries (MLA: one compressed latent and the RoPE key).
        total += sum(choice.local(shape, axes) for shape, axes in
                     kind_of(att).cache_entries(att, batch, cache_seq).values())
    return total * choice.compute_bytes
