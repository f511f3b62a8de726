"""Inference's model functions: the KV cache, prefill and one decode step. Choosing tokens and
the generation loop live in the runtime (runtime/sampling.py, runtime/generate.py), shared by
artifacts and `mxc generate MODEL`.

The cache is a pytree shaped like the layer stack:

    {"index": int32 scalar (slots written so far; the positions say which token each holds),
     "positions": [batch, cache_seq] int32 (EMPTY_SLOT where nothing is written yet),
     "segments": [[{"k": [layers, batch, cache_seq, kv_heads, head_dim], "v": ...}  # per period block
                   ...] ...]}                                                       # per segment

Each attention kind states its entries (mxc.compiler.kinds); an MLA block caches its compressed
latent instead of keys and values:
{"latent": [layers, batch, cache_seq, kv_lora], "k_rope": [layers, batch, cache_seq, rope]}.
A LongRoPE model's cache also keeps each row's tokens by position ("history": [batch, cache_seq]),
so a decode step can prefill a row again when it crosses original_max_seq (longrope_decode.py).

Prefill and decode are model.forward with a cache: no second attention implementation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mxc.compiler.kinds import kind_of
from mxc.compiler.lower.attention_core import EMPTY_SLOT
from mxc.compiler.lower.choices import lowering_choices
from mxc.compiler.lower import longrope_decode
from mxc.runtime.layer_layout import is_per_layer, per_layer
from mxc.compiler.lower.model import decoder_hidden, forward, logits_from_hidden
from mxc.compiler.quant import kv_cache
from mxc.spec.ir import ModelSpec


def _layer_cache_entries(att, batch: int, length: int, spec=None) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """One layer's cache arrays, unstacked: name -> (shape, logical axes), as its kind states them
    (with their scales where the spec stores the cache int8: compiler/quant/kv_cache.py)."""
    return kv_cache.with_scales(kind_of(att).cache_entries(att, batch, length), spec)


def init_cache(spec: ModelSpec, batch: int, length: int, dtype=None, image_tokens: int | None = None) -> dict:
    """An empty cache for `length` tokens (prompt plus everything to be generated). `image_tokens`:
    a model with cross_attention layers also keeps that many image keys and values per row in
    each of them, and the mask row decoding reuses (cross_attention.with_image_cache)."""
    dtype = jnp.dtype(dtype or spec.compute_dtype)
    segments = [[{entry: jnp.zeros((seg.repeat, *shape), kv_cache.entry_dtype(entry, dtype, spec)) for entry, (shape, _) in
                  _layer_cache_entries(spec.blocks[name].attention, batch, length, spec).items()}
                 for name in seg.period] for seg in spec.layers]
    cache = {"index": jnp.zeros((), jnp.int32),
             "positions": jnp.full((batch, length), EMPTY_SLOT, jnp.int32),
             "segments": segments, **longrope_decode.history_entry(spec, batch, length)}
    if image_tokens is None:
        return cache
    from mxc.compiler.lower import cross_attention

    return cross_attention.with_image_cache(spec, cache, image_tokens, dtype)


def cache_axes(spec: ModelSpec, image_tokens: bool = False) -> dict:
    """Logical axes of every cache entry (same tree as init_cache, `image_tokens` given or not)."""
    axes = {"index": (), "positions": ("batch", "cache_seq"),
            "segments": [[{entry: ("layers", *axes) for entry, (_, axes) in
                           _layer_cache_entries(spec.blocks[name].attention, 1, 1, spec).items()}
                          for name in seg.period] for seg in spec.layers],
            **({"history": ("batch", "cache_seq")} if longrope_decode.threshold(spec) is not None else {})}
    if not image_tokens:
        return axes
    from mxc.compiler.lower import cross_attention

    return cross_attention.image_cache_axes(spec, axes)


def _batch_axes(spec: ModelSpec, cache: dict) -> dict:
    """Each cache leaf's batch axis, for the cache's layout (stacked or per layer)."""
    axes = cache_axes(spec)
    segments = []
    for seg_axes, seg_cache in zip(axes["segments"], cache["segments"]):
        stacked = [{entry: names.index("batch") for entry, names in block.items()} for block in seg_axes]
        if is_per_layer(seg_cache):
            segments.append([[{entry: axis - 1 for entry, axis in block.items()} for block in stacked]
                             for _ in seg_cache])
        else:
            segments.append(stacked)
    return {"positions": 0, "segments": segments}


def prefill(spec: ModelSpec, params: dict, tokens: jax.Array, cache: dict, *, lengths: jax.Array | None = None,
            dtype=None, attention_impl: str = "xla", images: dict | None = None) -> tuple[jax.Array, dict]:
    """Run the prompt [batch, seq] into the cache; returns each row's logits [batch, vocab] at its
    last real token. Only those positions go through the output head: the others' logits would
    be thrown away (at a 128-token prompt the head over every position was a sixth of prefill).

    `lengths` [batch] lets rows be shorter than seq: they are right-padded, and causal attention
    keeps the padding out of the real tokens. The padding's cache slots are then marked empty, so
    no later token attends to them and a row's next position is its own length.
    `images`: {"pixel_values", "token_type_ids"} for a model with a vision tower, or image slots
    {"pixel_values" [batch, slots, ...], "image_mask"} (model.decoder_hidden)."""
    start, before = cache["index"], cache
    hidden, cache, _ = decoder_hidden(spec, params, tokens, cache=cache, dtype=dtype, attention_impl=attention_impl,
                                      **(images or {}))
    batch, seq = tokens.shape
    cache = longrope_decode.with_history(cache, before, tokens, start + jnp.arange(seq, dtype=jnp.int32)[None, :])
    if lengths is None:
        return logits_from_hidden(spec, params, hidden[:, -1:])[:, 0], cache
    lengths = lengths.astype(jnp.int32)
    real = jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None]
    written = jax.lax.dynamic_slice(cache["positions"], (0, start), (batch, seq))
    positions = jax.lax.dynamic_update_slice(cache["positions"], jnp.where(real, written, EMPTY_SLOT), (0, start))
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
    return logits_from_hidden(spec, params, last)[:, 0], {**cache, "positions": positions}


def next_positions(cache: dict) -> jax.Array:
    """[batch] int32: the position each row's next token takes (one past its last written one), so
    rows whose prompts had different lengths go on from their own."""
    written = jnp.where(cache["positions"] == EMPTY_SLOT, -1, cache["positions"])
    return jnp.max(written, axis=1) + 1


def decode_step(spec: ModelSpec, params: dict, tokens: jax.Array, cache: dict, *, dtype=None,
                attention_impl: str = "xla") -> tuple[jax.Array, dict]:
    """One new token per sequence (tokens [batch]), each at its row's next position; returns its
    logits [batch, vocab]."""
    positions, before = next_positions(cache), cache
    logits, cache = forward(spec, params, tokens[:, None], positions=positions[:, None], cache=cache,
                            dtype=dtype, attention_impl=attention_impl)
    if "history" not in before:
        return logits[:, -1], cache
    # LongRoPE: a row whose sequence just grew past original_max_seq is prefilled again (longrope_decode.py).
    cache = longrope_decode.with_history(cache, before, tokens[:, None], positions[:, None])

    def prefill_fresh(history):
        fresh = init_cache(spec, *cache["positions"].shape, dtype)
        if is_per_layer(params["segments"][0]):
            fresh = per_layer(fresh)
        return prefill(spec, params, history, fresh, dtype=dtype, attention_impl=attention_impl)

    return longrope_decode.recompute_crossing_rows(spec, positions, logits[:, -1], cache, prefill_fresh,
                                                   lambda c: _batch_axes(spec, c))


def serving_steps(spec: ModelSpec, batch: int, cache_len: int, *, dtype=None,
                  attention_impl: str = "xla", images: dict | None = None,
                  image_slots: bool = False) -> tuple[Callable, Callable]:
    """The two functions a generation driver runs, over a cache of cache_len slots for batch rows:
    prefill(params, tokens [batch, prompt_len], lengths [batch]) -> (logits, cache) on a fresh
    cache, and decode(params, tokens [batch], cache) -> (logits, cache). An artifact's serving
    build compiles them; `mxc generate MODEL` jits them. `images` (fixed arrays) go into every prefill.
    With `image_slots` (a vision model's artifact) prefill takes a fourth argument instead, each
    row's images in fixed slots (aot.serving_image_inputs: pixel_values [batch, slots, ...] and
    image_mask [batch, slots], and Llama 3.2 Vision's aspect ratios and cross-attention mask);
    decode is unchanged."""
    if (images and "cross_attention_mask" in images) or (image_slots and cross_attention_model(spec)):
        # Llama 3.2 Vision: the images' layers need them at every step
        from mxc.compiler.lower import cross_attention

        return cross_attention.serving_steps(spec, batch, cache_len, None if image_slots else images, dtype=dtype)

    def fresh_cache(params, length):
        cache = init_cache(spec, batch, length, dtype)
        # The cache follows the weights' layout (layer_layout.py).
        return per_layer(cache) if is_per_layer(params["segments"][0]) else cache

    def run_prefill(params, tokens, lengths, slot_images=None):
        own_keys = lowering_choices().prefill_own_keys and tokens.shape[1] < cache_len
        cache = fresh_cache(params, tokens.shape[1] if own_keys else cache_len)
        given = images if slot_images is None else {name: slot_images[name] for name in ("pixel_values", "image_mask")}
        logits, cache = prefill(spec, params, tokens, cache, lengths=lengths,
                                dtype=dtype, attention_impl=attention_impl, images=given)
        return logits, (_grown(cache, fresh_cache(params, cache_len)) if own_keys else cache)

    def run_decode(params, tokens, cache):
        return decode_step(spec, params, tokens, cache, dtype=dtype, attention_impl=attention_impl)

    return run_prefill, run_decode


def _grown(cache: dict, empty: dict) -> dict:
    """A prompt's cache written at the start of an empty cache of more slots (the same tree, each
    entry longer along its cache_seq axis): the slots after the prompt stay as init_cache made them."""
    return jax.tree.map(lambda full, written: written if full.shape == written.shape
                        else jax.lax.dynamic_update_slice(full, written, (0,) * full.ndim), empty, cache)


def cross_attention_model(spec: ModelSpec) -> bool:
    """Whether images reach the text model through cross_attention layers (Llama 3.2 Vision)."""
    from mxc.spec.ir import CrossAttention

    return any(isinstance(block.attention, CrossAttention) for block in spec.blocks.values())
