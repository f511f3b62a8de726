"""One decoder layer: pre-norm attention and pre-norm feed-forward, each added to the residual.

Gemma 2/3 also normalise each sub-layer's output (`post_norm`) before it joins the residual.
A parallel block (`parallel = true`) normalises its input once and adds attention and the
feed-forward of that one normed input to the residual together: x + attn(n) + mlp(n).
A MoE feed-forward also reports its routing statistics (moe.MoEStats); `block_layer_with_stats`
returns them, `block_layer` drops them.
"""

from __future__ import annotations

import jax

from mxc.compiler.kinds import kind_of
from mxc.compiler.lower.moe import MoEConfig, MoEStats
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.remat import named_residual
from mxc.compiler.lower.sharding import RESIDUAL_AXES, constrain
from mxc.spec.ir import Block, CrossAttention

# A parallel block's normed input, whole over the sequence: what both sub-layers' projections read.
GATHERED_AXES = ("batch", "seq", "embed")

def _shared_input(h: jax.Array) -> jax.Array:
    """The normalised input, computed once for all the projections that read it. Without the
    barrier XLA fuses the norm into each of those matmuls, forward and backward, and generates it
    again in every one of those kernels (about 8% of the compile time of Llama 3.1 8B's train step
    for v5p-1024); the values are the same either way."""
    return jax.lax.optimization_barrier(h)


def block_layer_with_stats(block: Block, params: dict, x: jax.Array, positions: jax.Array, *,
                           cache: dict | None = None, cache_index: jax.Array | None = None,
                           cache_positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                           image_blocks: jax.Array | None = None, cross_images=None, impl: str = "xla",
                           moe: MoEConfig = MoEConfig()) -> tuple[jax.Array, dict | None, MoEStats | None]:
    """(x after the layer, its updated cache slice, its MoEStats or None for a dense feed-forward).
    segment_ids [batch, seq]: the documents of a packed training sequence (attention stays inside each).
    image_blocks [batch, seq]: each token's image, -1 for text (attention is bidirectional inside one).
    cross_images (cross_attention.CrossImages): Llama 3.2 Vision's images, which only its
    cross_attention layers read."""
    if isinstance(block.attention, CrossAttention):
        if cross_images is None:
            return x, cache, None  # no image: transformers skips the layer
        from mxc.compiler.lower.cross_attention import cross_block_layer

        x, cache = cross_block_layer(block, params, x, cross_images, cache)
        return x, cache, None
    # Named so a remat policy can offload the layer's input (MaxText's main memory lever).
    x = named_residual(x, "decoder_layer_input")
    normed = apply_norm(block.norm, params["attention_norm"], x)
    if block.parallel:
        # Both sub-layers read the one normed input: gathered whole over the sequence once (under
        # sequence parallelism the residual is split over tensor), not once per sub-layer. Left
        # to XLA, the TPU program gathers it inside each sub-layer's windowed-einsum loops
        # instead, and runs slower by the step-time estimate (docs/plans.md, the 2023 rows).
        normed = constrain(normed, GATHERED_AXES)
    h = _shared_input(normed)
    a, new_cache = kind_of(block.attention).apply(block.attention, params["attention"], h, positions, cache=cache,
                                                  cache_index=cache_index, cache_positions=cache_positions,
                                                  segment_ids=segment_ids, impl=impl,
                                                  **({} if image_blocks is None else {"image_blocks": image_blocks}))
    if block.post_norm is not None:
        a = apply_norm(block.post_norm, params["attention_post_norm"], a)
    if block.parallel:
        m, stats = kind_of(block.mlp).apply(block.mlp, params["mlp"], h, moe)
        return constrain(x + a + m, RESIDUAL_AXES), new_cache, stats
    x = constrain(x + a, RESIDUAL_AXES)
    h = _shared_input(apply_norm(block.norm, params["mlp_norm"], x))
    m, stats = kind_of(block.mlp).apply(block.mlp, params["mlp"], h, moe)
    if block.post_norm is not None:
        m = apply_norm(block.post_norm, params["mlp_post_norm"], m)
    return constrain(x + m, RESIDUAL_AXES), new_cache, stats


def block_layer(block: Block, params: dict, x: jax.Array, positions: jax.Array,
                **kwargs) -> tuple[jax.Array, dict | None]:
    x, new_cache, _ = block_layer_with_stats(block, params, x, positions, **kwargs)
    return x, new_cache
