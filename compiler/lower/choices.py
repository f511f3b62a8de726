"""Choices of the lowering that depend on the target, fixed by the plan.

A plan records them (Plan.lowering) and the program's functions are traced under
`use_lowering`, so the plan file, not the mesh or the backend that happens to trace it, decides
the program. Code traced without a plan (`mxc forward`, `mxc generate MODEL`, tests) gets the
choice for the platform of its mesh, or of the default backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class LoweringChoices:
    stacked_projections: bool  # projections of one input as one matmul over stacked kernels
    interpret_kernels: bool  # Pallas kernels (megablox) in the interpreter, as off a TPU
    quantization: str = "fp32"  # compiler/quant/config.py's name; set from the spec's `quantize`
    # The output head's matmul writes float32 logits; False: the activations' dtype, cast to
    # float32 for the loss (MaxText's default, logits_dot_in_fp32: False), which halves the
    # [tokens, vocab] logits XLA keeps for the backward pass. Set by --maxtext.
    float32_logits_dot: bool = True
    # The output head and cross entropy of a training step run over this many pieces of the
    # sequence, each piece's logits recomputed in the backward pass (loss.chunked_loss_sums), so
    # one piece's float32 logits exist at a time: 1/chunks of them, for a second head matmul.
    loss_chunks: int = 1
    # AdamW's moments live in host memory (pinned_host) between steps: the train step's state
    # takes and returns them there and brings each to HBM only for its update (train.py), so HBM
    # holds them transiently. MaxText's optimizer_memory_host_offload; a TPU feature (the host
    # link is charged per step, compiler/plan/cost.py).
    optimizer_state_on_host: bool = False
    # CPU-only choices, which the plan's chip decides (Plan.lowering_choices); docs/runtime.md
    # has the measurements. Weight products' backward passes as canonical row-major matrix
    # products (weight_gradients.py): XLA:CPU otherwise copies the large gradient transposed.
    canonical_weight_gradients: bool = False
    # The cross entropy's per-token statistics with a hand-written gradient (loss.py): no
    # [tokens, vocab] intermediates beyond the logits and their gradient.
    fused_cross_entropy: bool = False
    # A large stored weight of another dtype (int8, bf16: the tied head) converted and multiplied in
    # cache-sized blocks (compiler/quant/matmul.py): XLA:CPU writes the whole converted copy first.
    blocked_weight_conversion: bool = False
    # The dropless experts' dispatch (expert_dispatch.py): its grouped matmul, "megablox" (the
    # Pallas kernel; XLA's TPU backend runs ragged_dot as a masked matmul over every expert) or
    # "ragged_dot", and whether its exchange is jax.lax.ragged_all_to_all (XLA:CPU has none).
    grouped_matmul: str = "ragged_dot"
    ragged_all_to_all: bool = False
    # The chip's peak FLOPs per byte of HBM bandwidth and the VMEM a kernel may take, by which
    # megablox sizes its tiles (megablox.tiling); 0 where the chip is not known.
    grouped_flops_per_byte: float = 0.0
    grouped_vmem_bytes: int = 0
    # Serving programs take one array per layer and run the layers one after another, without
    # copying each layer's weights out of a stack at every decode step (layer_layout.py).
    per_layer_serving: bool = False
    # A serving prefill attends to the prompt's own keys in a cache of the prompt's length, then
    # writes that cache into the empty full-length one; otherwise it attends to every slot of the
    # full cache, whose slots after the prompt are all empty (docs/runtime.md, "Time to first token").
    prefill_own_keys: bool = False
    # Causal self-attention without a cache (training, evaluation) in this many query blocks, each
    # attending to the keys up to its own end (attention_blocks.py): the scores above the diagonal's
    # blocks are not computed. 1: the one-block core (TPU plans; splash skips those tiles itself).
    causal_query_blocks: int = 1
    # CPU serving's per-layer conversion joins each layer's q/k/v kernels into one [embed, heads +
    # 2 kv_heads, head_dim] and gate/up into one [embed, 2 mlp] (layer_layout.py), so a decode step
    # runs 4 weight products a layer instead of 7; the lowering splits the products' outputs.
    joined_serving_projections: bool = False

    @classmethod
    def for_platform(cls, platform: str) -> "LoweringChoices":
        # TPUs: one larger matmul suits the MXUs and compiles faster; on CPUs the stacked copy of
        # the weights costs more than the shared matmul saves (docs/compile.md). Pallas's Mosaic
        # kernels compile only for TPUs; elsewhere they run in its interpreter.
        cpu, tpu = platform == "cpu", platform == "tpu"
        return cls(stacked_projections=tpu, interpret_kernels=not tpu,
                   canonical_weight_gradients=cpu, fused_cross_entropy=cpu, blocked_weight_conversion=cpu,
                   grouped_matmul="megablox" if tpu else "ragged_dot", ragged_all_to_all=tpu,
                   per_layer_serving=cpu, prefill_own_keys=cpu,
                   causal_query_blocks=4 if cpu else 1, joined_serving_projections=cpu)

    @classmethod
    def for_chip(cls, chip) -> "LoweringChoices":
        """The platform's choices, with what the kernels size by the chip (a topology.Chip)."""
        return dataclasses.replace(cls.for_platform(chip.platform),
                                   grouped_flops_per_byte=chip.peak_bf16_flops / chip.hbm_bandwidth
                                   if chip.hbm_bandwidth else 0.0, grouped_vmem_bytes=chip.kernel_vmem_bytes)

    def serves_per_layer(self, quantize: str | None) -> bool:
        """Whether serving programs for a spec quantized as `quantize` take one array per layer:
        not with quantized weights, whose per-layer conversion decoded 2-4x slower than the
        stacked scan's on CPUs (docs/serving.md)."""
        from mxc.compiler.quant.config import parse

        return self.per_layer_serving and not parse(quantize or "fp32").quantizes_weights

    def with_recorded(self, recorded: dict) -> "LoweringChoices":
        """These choices with those a plan file records (the rest stay the platform's)."""
        return dataclasses.replace(self, **recorded)


_PLANNED: contextvars.ContextVar[LoweringChoices | None] = contextvars.ContextVar("mxc_lowering", default=None)


@contextlib.contextmanager
def use_lowering(choices: LoweringChoices):
    token = _PLANNED.set(choices)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def lowering_choices() -> LoweringChoices:
    """The plan's choices where a plan's function is being traced; else those of the platform of
    the active mesh (or of the default backend)."""
    planned = _PLANNED.get()
    if planned is not None:
        return planned
    from mxc.compiler.lower.sharding import active_rules

    active = active_rules()
    platform = active[0].devices.flat[0].platform if active is not None else jax.default_backend()
    return LoweringChoices.for_platform(platform)
