"""The forward pass: embed, run each segment of layers with one lax.scan, normalise, project.

    forward(spec, params, tokens, *, positions=None, segment_ids=None, cache=None, remat_policy=None,
            attention_impl="xla", dtype=None, moe=MoEConfig()) -> (logits, new_cache)

tokens [batch, seq] int; positions [batch, seq] (default: counting on from the cache's index,
or from 0); segment_ids [batch, seq] int (training only, no cache): a packed row of several
documents, each token's document id, with `positions` restarting at 0 in each document, so
that attention stays inside a document and RoPE counts from its start; logits [batch, seq,
vocab] in float32. `dtype` overrides spec.compute_dtype.
Without a cache, new_cache is None; with one (see decode.init_cache) the step's keys and values
are written at cache["index"] and the updated cache is returned, so prefill and decode are this
same function. `remat_policy` (a jax.checkpoint policy, e.g. one built from CHECKPOINT_NAMES)
wraps the scanned body in jax.checkpoint; None runs it without rematerialisation. `moe` says how
MoE layers run (moe.MoEConfig); `forward_with_aux` also returns their routing statistics, one
moe.MoEStats (stacked over the segment's layers) per block of each segment's period, None for
dense blocks, for the load-balancing loss and DeepSeek's bias update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mxc.compiler.lower import attention, ffn
from mxc.compiler.lower.block import RESIDUAL_AXES, block_layer_with_stats
from mxc.compiler.lower.choices import lowering_choices
from mxc.compiler.lower.loss import LossSums, chunked_loss_sums, loss_sums
from mxc.runtime.layer_layout import is_per_layer
from mxc.compiler.lower.moe import MoEConfig
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import embedded, head_params, project, quantized_as_spec
from mxc.compiler.lower.sharding import constrain
from mxc.spec.ir import ModelSpec, Segment

CHECKPOINT_NAMES = ("decoder_layer_input",) + attention.CHECKPOINT_NAMES + ffn.CHECKPOINT_NAMES


def embed(spec: ModelSpec, params: dict, tokens: jax.Array, dtype) -> jax.Array:
    x = embedded(params["embed"], tokens, dtype)
    if spec.embedding.scale == "sqrt_d_model":
        # Gemma rounds the scale to the activation dtype before multiplying.
        x = x * jnp.asarray(math.sqrt(spec.d_model), dtype)
    return constrain(x, RESIDUAL_AXES)


def logits_from_hidden(spec: ModelSpec, params: dict, x: jax.Array) -> jax.Array:
    """Final norm, output head (tied or not) and soft-cap; float32 logits [batch, seq, vocab]."""
    return output_head(spec, params, apply_norm(spec.final_norm, params["final_norm"], x))


def head_loss_sums(spec: ModelSpec, params: dict, hidden: jax.Array, targets: jax.Array, mask: jax.Array | None,
                   *, z_loss_weight: float = 0.0) -> LossSums:
    """The training loss's sums from the last layer's output: final norm, head, cross entropy;
    over pieces of the sequence where the plan asks (LoweringChoices.loss_chunks), so the float32
    logits never exist whole."""
    chunks = lowering_choices().loss_chunks
    if chunks > 1:
        return chunked_loss_sums(lambda h: logits_from_hidden(spec, params, h), hidden, targets, mask, chunks,
                                 z_loss_weight=z_loss_weight)
    return loss_sums(logits_from_hidden(spec, params, hidden), targets, mask, z_loss_weight=z_loss_weight)


@quantized_as_spec
def output_head(spec: ModelSpec, params: dict, x: jax.Array) -> jax.Array:
    """The output head (tied or not) and soft-cap on normalised x; float32 logits [batch, seq, vocab].
    DeepSeek V3's multi-token prediction modules share it with the main model."""
    out_dtype = jnp.float32 if lowering_choices().float32_logits_dot else None  # None: x's dtype
    logits = project(x, head_params(params, spec.embedding.tied),
                     "bse,ve->bsv" if spec.embedding.tied else "bse,ev->bsv", x.dtype,
                     out_dtype=out_dtype).astype(jnp.float32)
    if spec.final_softcap is not None:
        logits = jnp.tanh(logits / spec.final_softcap) * spec.final_softcap
    return constrain(logits, ("batch", "seq", "vocab"))


def run_segment(spec: ModelSpec, segment: Segment, params: list, x: jax.Array, positions: jax.Array, *,
                cache: list | None = None, cache_index=None, cache_positions=None, segment_ids=None,
                image_blocks=None, cross_images=None, remat_policy=None, attention_impl: str = "xla",
                moe: MoEConfig = MoEConfig()) -> tuple[jax.Array, list | None, list]:
    """Scan the segment's period over its stacked layers; returns (x, the segment's new cache,
    its MoE statistics per period block). cross_images: Llama 3.2 Vision's images for its
    cross_attention layers (cross_attention.CrossImages)."""

    def body(x, layer):
        layer_params, layer_cache = layer
        new_cache, stats = [], []
        for p, name in enumerate(segment.period):
            x, c, s = block_layer_with_stats(spec.blocks[name], layer_params[p], x, positions,
                                             cache=None if layer_cache is None else layer_cache[p],
                                             cache_index=cache_index, cache_positions=cache_positions,
                                             segment_ids=segment_ids, image_blocks=image_blocks,
                                             cross_images=cross_images, impl=attention_impl, moe=moe)
            new_cache.append(c)
            stats.append(s)
        return x, (new_cache if layer_cache is not None else None, stats)

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    if is_per_layer(params):  # serving on a CPU: one array per layer, no copies out of a stack
        return _run_layers(body, params, x, cache)
    x, (new_cache, stats) = jax.lax.scan(body, x, (params, cache))
    return x, new_cache, stats


def _run_layers(body, params: list, x: jax.Array, cache: list | None) -> tuple[jax.Array, list | None, list]:
    """run_segment's scan as a Python loop over per-layer parameters and, where given, a per-layer
    cache (layer_layout.py): a stacked cache would be copied whole at every layer's update."""
    new_cache, stats = [], []
    for index, layer_params in enumerate(params):
        x, (layer_cache, layer_stats) = body(x, (layer_params, None if cache is None else cache[index]))
        new_cache.append(layer_cache)
        stats.append(layer_stats)
    stats = jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *stats) if stats else stats
    return x, None if cache is None else new_cache, stats


def _pipelined_segment_index(spec: ModelSpec) -> int:
    from mxc.compiler.lower.pipeline import pipelined_segment_index  # the planner's import, only with stages

    return pipelined_segment_index(spec)


def forward(spec: ModelSpec, params: dict, tokens: jax.Array, **kwargs) -> tuple[jax.Array, dict | None]:
    logits, new_cache, _ = forward_with_aux(spec, params, tokens, **kwargs)
    return logits, new_cache


def forward_with_aux(spec: ModelSpec, params: dict, tokens: jax.Array, **kwargs) -> tuple[jax.Array, dict | None, list]:
    x, new_cache, moe_stats = decoder_hidden(spec, params, tokens, **kwargs)
    return logits_from_hidden(spec, params, x), new_cache, moe_stats


@quantized_as_spec
def decoder_hidden(spec: ModelSpec, params: dict, tokens: jax.Array, *, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, cache: dict | None = None, remat_policy=None,
                   attention_impl: str = "xla", pixel_values: jax.Array | None = None,
                   token_type_ids: jax.Array | None = None, image_mask: jax.Array | None = None,
                   aspect_ratio_ids: jax.Array | None = None, dtype=None, moe: MoEConfig = MoEConfig(), pipeline=None) -> tuple[jax.Array, dict | None, list]:
    """`forward_with_aux` up to the last layer's output x [batch, seq, embed], before the final
    norm: (x, new_cache, moe_stats). DeepSeek V3's multi-token prediction starts from it.
    pixel_values [images, channels, height, width] (a model with a vision tower): the encoded images
    replace the embeddings of the image placeholders in `tokens`, in order; token_type_ids
    [batch, seq] (1 for image tokens; default: the placeholders) marks the tokens that attend
    bidirectionally within their image where the tower's entry asks for it. A training batch's
    pixel_values are [batch, slots, channels, height, width] with image_mask [batch, slots]: each
    row's placeholders take that row's images (image_slots.py); for Llama 3.2 Vision they are
    [batch, slots, tiles, channels, height, width] with aspect_ratio_ids [batch, slots], and the
    cross_attention layers read them (image_slots.cross_image_slots)."""
    dtype = jnp.dtype(dtype or spec.compute_dtype)
    batch, seq = tokens.shape
    start = 0 if cache is None else cache["index"]
    if segment_ids is not None and cache is not None:
        raise ValueError("segment ids are for packed training sequences; a KV cache holds one document per row")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None, :] + start, (batch, seq))
    positions = positions.astype(jnp.int32)
    cache_positions = None
    if cache is not None:
        cache_positions = jax.lax.dynamic_update_slice(cache["positions"], positions, (0, start))
    image_blocks = cross_images = None
    if aspect_ratio_ids is not None:
        from mxc.compiler.lower.image_slots import cross_image_slots

        cross_images = cross_image_slots(spec, params, tokens, pixel_values, image_mask, aspect_ratio_ids,
                                         segment_ids, dtype, remat_policy)
        x = embed(spec, params, tokens, dtype)
    elif pixel_values is not None and pixel_values.ndim == 5:
        from mxc.compiler.lower.image_slots import with_image_slots

        x, image_blocks = with_image_slots(spec, params, tokens, lambda p: embed(spec, p, tokens, dtype),
                                           pixel_values, image_mask, dtype, remat_policy)
    else:
        x = embed(spec, params, tokens, dtype)
        if pixel_values is not None:
            from mxc.compiler.lower import vision

            x, image_blocks = vision.with_images(spec, params, tokens, x, pixel_values, token_type_ids)
    new_segments, moe_stats = [], []
    for s, segment in enumerate(spec.layers):
        if pipeline is not None and s == _pipelined_segment_index(spec):
            # A plan with stages (pipeline: pipeline.PipelineLayout) trains its largest segment
            # through the circular pipeline; the parameters keep the flat layer order.
            from mxc.compiler.lower.pipeline import pipelined_segment

            if cache is not None:
                raise ValueError("a pipeline runs training steps; a KV cache runs without one")
            if cross_images is not None:
                raise NotImplementedError("the pipeline does not pass images to cross_attention layers yet")
            x, seg_stats = pipelined_segment(spec, segment, params["segments"][s], x, positions, layout=pipeline,
                                             segment_ids=segment_ids, remat_policy=remat_policy,
                                             attention_impl=attention_impl, moe=moe)
            new_segments.append(None)
            moe_stats.append(seg_stats)
            continue
        x, seg_cache, seg_stats = run_segment(spec, segment, params["segments"][s], x, positions,
                                              cache=None if cache is None else cache["segments"][s],
                                              cache_index=start, cache_positions=cache_positions,
                                              segment_ids=segment_ids, image_blocks=image_blocks,
                                              cross_images=cross_images, remat_policy=remat_policy,
                                              attention_impl=attention_impl, moe=moe)
        new_segments.append(seg_cache)
        moe_stats.append(seg_stats)
    if cache is None:
        return x, None, moe_stats
    return x, {"index": start + seq, "positions": cache_positions, "segments": new_segments}, moe_stats
