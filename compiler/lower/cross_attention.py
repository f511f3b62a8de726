"""Llama 3.2 Vision's image path: the tower's projected tiles become the keys and values of the
text model's cross_attention layers.

    cross_images(spec, params, pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask, dtype)
        -> CrossImages
    forward(spec, params, tokens, *, images=None, cache=None, dtype=None) -> (logits, new_cache)

Inputs are as transformers' MllamaProcessor makes them: pixel_values [batch, images, tiles,
channels, tile, tile], aspect_ratio_ids [batch, images], aspect_ratio_mask [batch, images, tiles],
cross_attention_mask [batch, seq, images, tiles] (1 where a text token may see a tile).

As transformers applies the mask (`_prepare_cross_attention_mask`): a token sees the tokens of
the tiles its mask row allows; a row that allows none (text before the first image) sees every
image token instead, and its feed-forward output is dropped, so only the gated attention output
joins its residual. Without images every cross_attention layer is skipped, as transformers skips
them. Decoding reuses the last prompt row's mask for every new token (transformers'
`_update_model_kwargs_for_generation`). serving_steps' prefill writes each cross layer's image
keys and values into the cache (decode.init_cache's `image_tokens`: sized by the images, or by an
artifact's image slots, so outside the kinds' cache_entries), and decoding reads them there; a
cache without them has them projected again at every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mxc.compiler.kinds.vision import num_positions
from mxc.compiler.kinds import kind_of
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project
from mxc.compiler.lower.sharding import RESIDUAL_AXES, constrain
from mxc.compiler.lower.vision_mllama import encode_tiles, project_tiles
from mxc.spec.ir import Block, CrossAttention, ModelSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CrossImages:
    states: jax.Array | None  # [batch, image tokens, d_model]: a row's projected tiles, in order; None
    # once the cross layers' keys and values are in the cache (decoding after serving_steps' prefill)
    visible: jax.Array  # [batch, seq, image tokens] bool: which image tokens each text token sees
    sees_image: jax.Array  # [batch, seq] bool: the mask row allows some tile
    # [batch, seq] bool, or None for all: False where the token's document has no image, so the
    # layer leaves it alone (a packed training row; transformers skips the layer for such a text)
    takes_image: jax.Array | None = None

    def last_row(self) -> "CrossImages":
        """The mask for tokens decoded after the prompt: its last row, as transformers extends it."""
        return CrossImages(self.states, self.visible[:, -1:], self.sees_image[:, -1:],
                           None if self.takes_image is None else self.takes_image[:, -1:])


def image_states(spec: ModelSpec, params: dict, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                 dtype, remat_policy=None) -> jax.Array:
    """The projected tiles of each row's images: [batch, images * tiles * tokens per tile, d_model]."""
    tower = spec.vision
    batch, images, tiles = pixel_values.shape[:3]
    vp = params["vision"]
    features = encode_tiles(tower, vp, pixel_values.reshape(batch * images, *pixel_values.shape[2:]),
                            aspect_ratio_ids.reshape(-1), aspect_ratio_mask.reshape(batch * images, tiles), dtype,
                            remat_policy)
    return project_tiles(vp, features, dtype).reshape(batch, images * tiles * num_positions(tower), -1)


def cross_images(spec: ModelSpec, params: dict, pixel_values, aspect_ratio_ids, aspect_ratio_mask,
                 cross_attention_mask, dtype) -> CrossImages:
    states = image_states(spec, params, pixel_values, aspect_ratio_ids, aspect_ratio_mask, dtype)
    allowed = jnp.repeat(cross_attention_mask.astype(bool), num_positions(spec.vision), axis=3)
    allowed = allowed.reshape(*cross_attention_mask.shape[:2], -1)
    sees_image = allowed.any(axis=-1)
    return CrossImages(states, allowed | ~sees_image[..., None], sees_image)


def cross_block_layer(block: Block, params: dict, x: jax.Array, images: CrossImages,
                      cache: dict | None = None) -> tuple[jax.Array, dict | None]:
    """One cross_attention layer (transformers' MllamaCrossAttentionDecoderLayer). A cache slice
    with "k" and "v" (serving_steps sizes it by the images) takes the image keys and values made
    from images.states, or gives them when states is None."""
    att, dtype = block.attention, x.dtype
    ap = params["attention"]
    h = apply_norm(block.norm, params["attention_norm"], x)
    q = project(h, ap["q"], "bse,ehd->bshd", dtype)
    if att.qk_norm is not None:
        q = apply_norm(att.qk_norm, ap["q_norm"], q)
    if images.states is None:
        k, v = cache["k"], cache["v"]
    else:
        k = project(images.states.astype(dtype), ap["k"], "bte,ehd->bthd", dtype)
        v = project(images.states.astype(dtype), ap["v"], "bte,ehd->bthd", dtype)
        if att.qk_norm is not None:
            k = apply_norm(att.qk_norm, ap["k_norm"], k)
        if cache is not None and "k" in cache:
            cache = {**cache, "k": k.astype(cache["k"].dtype), "v": v.astype(cache["v"].dtype)}
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    # An arbitrary text-by-image-token mask, which attend's position-based masks cannot state.
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * head_dim ** -0.5
    scores = jnp.where(images.visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    context = jnp.einsum("bkgst,btkd->bskgd", probs, v, preferred_element_type=jnp.float32)
    context = context.reshape(batch, seq, heads, head_dim).astype(dtype)
    out = project(context, ap["o"], "bshd,hde->bse", dtype)
    if att.gated:
        out = jnp.tanh(ap["attention_gate"].astype(jnp.float32)).astype(dtype) * out
    if images.takes_image is not None:
        out = out * images.takes_image[..., None].astype(dtype)
    x = constrain(x + out, RESIDUAL_AXES)
    h, _ = kind_of(block.mlp).apply(block.mlp, params["mlp"], apply_norm(block.norm, params["mlp_norm"], x), None)
    h = h * images.sees_image[..., None].astype(dtype)
    if att.gated:
        h = jnp.tanh(ap["mlp_gate"].astype(jnp.float32)).astype(dtype) * h
    return constrain(x + h, RESIDUAL_AXES), cache


def forward(spec: ModelSpec, params: dict, tokens: jax.Array, *, images: CrossImages | None = None,
            cache: dict | None = None, positions: jax.Array | None = None, dtype=None) -> tuple[jax.Array, dict | None]:
    """Float32 logits [batch, seq, vocab] and the new cache (model.forward's, for a model with
    cross_attention layers); `images` reach the cross layers through run_segment's cross_images."""
    from mxc.compiler.lower.model import embed, logits_from_hidden, run_segment

    dtype = jnp.dtype(dtype or spec.compute_dtype)
    batch, seq = tokens.shape
    start = 0 if cache is None else cache["index"]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None, :] + start, (batch, seq))
    cache_positions = None
    if cache is not None:
        cache_positions = jax.lax.dynamic_update_slice(cache["positions"], positions, (0, start))
    x = embed(spec, params, tokens, dtype)
    new_segments = []
    for s, segment in enumerate(spec.layers):
        x, seg_cache, _ = run_segment(spec, segment, params["segments"][s], x, positions,
                                      cache=None if cache is None else cache["segments"][s],
                                      cache_index=start, cache_positions=cache_positions, cross_images=images)
        new_segments.append(seg_cache)
    logits = logits_from_hidden(spec, params, x)
    if cache is None:
        return logits, None
    return logits, {"index": start + seq, "positions": cache_positions, "segments": new_segments}


INPUTS = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")


def forward_with_inputs(spec: ModelSpec, params: dict, tokens: jax.Array, *, dtype=None, **inputs) -> jax.Array:
    """Float32 logits from the processor's inputs (INPUTS, as `mxc forward --images` reads them)."""
    dtype = jnp.dtype(dtype or spec.compute_dtype)
    images = cross_images(spec, params, *(inputs[name] for name in INPUTS), dtype)
    return forward(spec, params, tokens, images=images, dtype=dtype)[0]


def serving_steps(spec: ModelSpec, batch: int, cache_len: int, inputs: dict | None, *, dtype=None):
    """decode.serving_steps for a model with cross_attention layers: prefill makes the images'
    CrossImages once, writes each cross layer's image keys and values into the cache and keeps the
    mask (`cross`: each row's last real mask row, which every decoded token reuses); decode reads
    both from there. `inputs`: the processor's arrays (INPUTS), fixed; None: prefill takes each
    row's images in fixed slots as a fourth argument (slot_cross_images; an artifact's prefill)."""
    from mxc.compiler.lower.attention_core import EMPTY_SLOT
    from mxc.compiler.lower.decode import init_cache, next_positions

    compute = jnp.dtype(dtype or spec.compute_dtype)

    def run_prefill(params, tokens, lengths, slot_images=None):
        if slot_images is None:
            images = cross_images(spec, params, *(inputs[name] for name in INPUTS), compute)
        else:
            images = slot_cross_images(spec, params, slot_images, compute)
        cache = init_cache(spec, batch, cache_len, dtype, image_tokens=images.states.shape[1])
        logits, cache = forward(spec, params, tokens, images=images, cache=_text_cache(cache), dtype=dtype)
        last = (lengths.astype(jnp.int32) - 1)[:, None]
        real = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] <= last
        positions = cache["positions"].at[:, :tokens.shape[1]].set(
            jnp.where(real, cache["positions"][:, :tokens.shape[1]], EMPTY_SLOT))
        row = {"visible": jnp.take_along_axis(images.visible, last[:, :, None], axis=1),
               "sees_image": jnp.take_along_axis(images.sees_image, last, axis=1)}
        logits = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]
        return logits, {**cache, "positions": positions, "cross": row}

    def run_decode(params, tokens, cache):
        text_cache = _text_cache(cache)
        images = CrossImages(None, cache["cross"]["visible"], cache["cross"]["sees_image"])
        logits, text_cache = forward(spec, params, tokens[:, None], images=images, cache=text_cache,
                                     positions=next_positions(text_cache)[:, None], dtype=dtype)
        return logits[:, -1], {**text_cache, "cross": cache["cross"]}

    return run_prefill, run_decode


def _text_cache(cache: dict) -> dict:
    return {key: value for key, value in cache.items() if key != "cross"}


def slot_cross_images(spec: ModelSpec, params: dict, images: dict, dtype) -> CrossImages:
    """CrossImages of a serving batch's image slots: pixel_values [batch, slots, tiles, channels,
    tile, tile], image_mask [batch, slots] (True where a slot holds an input image),
    aspect_ratio_ids [batch, slots], aspect_ratio_mask [batch, slots, tiles] and
    cross_attention_mask [batch, seq, slots, tiles] as the processor makes them for the slots that
    hold images. An empty slot is encoded as one tile (all padding is no input the tower takes),
    zeroed, and seen by no token, not even by text that sees no image (which sees every image the
    row holds)."""
    pixels, mask = images["pixel_values"], images["image_mask"].astype(bool)
    batch, slots, tiles = pixels.shape[:3]
    first_tile = jnp.arange(tiles)[None, None, :] == 0
    tile_mask = jnp.where(mask[..., None], images["aspect_ratio_mask"].astype(bool), first_tile)
    states = image_states(spec, params, pixels, jnp.where(mask, images["aspect_ratio_ids"], 1),
                          tile_mask.astype(jnp.int32), dtype)
    per_slot = tiles * num_positions(spec.vision)
    states = jnp.where(jnp.repeat(mask, per_slot, axis=1)[..., None], states, jnp.zeros((), states.dtype))
    cross = images["cross_attention_mask"].astype(bool) & mask[:, None, :, None]
    allowed = jnp.repeat(cross, num_positions(spec.vision), axis=3).reshape(batch, cross.shape[1], -1)
    sees_image = allowed.any(axis=-1)
    present = jnp.repeat(mask, per_slot, axis=1)[:, None, :]
    return CrossImages(states, allowed | (~sees_image[..., None] & present), sees_image)


def with_image_cache(spec: ModelSpec, cache: dict, image_tokens: int, dtype) -> dict:
    """The cache with a "k" and "v" of image_tokens rows in every cross_attention layer's slice,
    and the mask row each decoded token reuses ("cross": visible [batch, 1, image_tokens],
    sees_image [batch, 1]), all empty until a prefill writes them."""
    dtype = jnp.dtype(dtype or spec.compute_dtype)
    batch = cache["positions"].shape[0]
    segments = []
    for segment, slices in zip(spec.layers, cache["segments"]):
        segments.append([])
        for name, layer_cache in zip(segment.period, slices):
            att = spec.blocks[name].attention
            if isinstance(att, CrossAttention):
                shape = (segment.repeat, batch, image_tokens, att.kv_heads, att.head_dim)
                layer_cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            segments[-1].append(layer_cache)
    cross = {"visible": jnp.zeros((batch, 1, image_tokens), bool), "sees_image": jnp.zeros((batch, 1), bool)}
    return {**cache, "segments": segments, "cross": cross}


IMAGE_CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")  # the image tokens stay whole


def image_cache_axes(spec: ModelSpec, axes: dict) -> dict:
    """decode.cache_axes' tree for with_image_cache's cache."""
    segments = [[IMAGE_CACHE_AXES_ENTRIES if isinstance(spec.blocks[name].attention, CrossAttention) else entries
                 for name, entries in zip(segment.period, slices)]
                for segment, slices in zip(spec.layers, axes["segments"])]
    return {**axes, "segments": segments, "cross": {"visible": ("batch", None, None), "sees_image": ("batch", None)}}


IMAGE_CACHE_AXES_ENTRIES = {"k": IMAGE_CACHE_AXES, "v": IMAGE_CACHE_AXES}
