"""Images in a training batch: a fixed number of image slots per row, and their soft tokens
placed at that row's placeholders.

    with_image_slots(spec, params, tokens, embed, pixel_values, image_mask, dtype) -> (x, image_blocks)
    cross_image_slots(spec, params, tokens, pixel_values, image_mask, aspect_ratio_ids, segment_ids, dtype)
        -> CrossImages (Llama 3.2 Vision: its cross_attention layers read them; the masks: cross_masks)

pixel_values [batch, slots, channels, height, width] and image_mask [batch, slots] (True where a
slot holds an image) are the batch's `pixel_values` and `image_mask` (runtime/data.py fills them).
Row b's k-th placeholder run takes the soft tokens of row b's k-th slot, so rows never share
images and a row's unused slots are never read. The forward pass's images (vision.with_images)
are one flat list for the whole prompt batch; here every row is its own list, which keeps the
gather local to the device holding the row.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mxc.compiler.lower import vision
from mxc.spec.ir import ModelSpec


def with_image_slots(spec: ModelSpec, params: dict, tokens: jax.Array, embed: Callable[[dict], jax.Array],
                     pixel_values: jax.Array, image_mask: jax.Array | None, dtype,
                     remat_policy=None) -> tuple[jax.Array, jax.Array | None]:
    """`embed(params)` gives the text embeddings [batch, seq, d_model], computed after the images."""
    if spec.vision is None:
        raise ValueError(f"{spec.name} has no vision tower; it takes no images")
    rows, slots = pixel_values.shape[:2]
    entry = spec.vision.entry
    features = vision.encode_images(spec, params, pixel_values.reshape(rows * slots, *pixel_values.shape[2:]),
                                    dtype, remat_policy)
    # The text embeddings wait for the images. Put here against a cpu-8 deadlock whose cause was
    # XLA:CPU's thread pool (runtime/cpu_devices.py), not this order; kept because the
    # multimodal plans' XLA memory figures (docs/multimodal.md) were measured with it.
    features, embedding = jax.lax.optimization_barrier((features, params["embed"]))
    x = embed({**params, "embed": embedding})
    per_image, width = features.shape[1:]
    features = features.reshape(rows, slots, per_image, width)
    if image_mask is not None:  # an empty slot contributes nothing, not even through a stray placeholder
        features = jnp.where(image_mask[:, :, None, None], features, jnp.zeros((), features.dtype))
    features = features.reshape(rows, slots * per_image, width)
    placeholder = tokens == entry.token
    index = jnp.cumsum(placeholder.astype(jnp.int32), axis=1) - 1
    index = jnp.clip(index, 0, slots * per_image - 1)
    gathered = jnp.take_along_axis(features, index[..., None], axis=1)
    x = jnp.where(placeholder[..., None], gathered, x)
    return x, (vision.image_blocks(placeholder) if entry.bidirectional else None)



def cross_image_slots(spec: ModelSpec, params: dict, tokens: jax.Array, pixel_values: jax.Array,
                      image_mask: jax.Array | None, aspect_ratio_ids: jax.Array, segment_ids: jax.Array | None,
                      dtype, remat_policy=None) -> "CrossImages":
    """Llama 3.2 Vision's images in a training batch, for its cross_attention layers: pixel_values
    [batch, slots, tiles, channels, tile, tile], aspect_ratio_ids [batch, slots] (0 in an empty
    slot); row b's k-th image token marks where slot k's image stands (masks: cross_masks)."""
    from mxc.compiler.kinds.vision import num_positions
    from mxc.compiler.lower.cross_attention import CrossImages, image_states

    tower = spec.vision
    rows, slots, tiles = pixel_values.shape[:3]
    image_mask = aspect_ratio_ids > 0 if image_mask is None else image_mask & (aspect_ratio_ids > 0)
    allowed, same_document, tile_mask = cross_masks(spec, tokens, segment_ids, image_mask, aspect_ratio_ids, tiles)
    # An empty slot is encoded as one tile of arrangement 1 (no image is all padding), then zeroed.
    first_tile = jnp.arange(tiles)[None, None, :] == 0
    encoded_mask = jnp.where(image_mask[..., None], tile_mask, first_tile).astype(jnp.int32)
    states = image_states(spec, params, pixel_values, jnp.where(image_mask, aspect_ratio_ids, 1), encoded_mask, dtype,
                          remat_policy)
    per_image = tiles * num_positions(tower)
    states = states.reshape(rows, slots, per_image, -1)
    states = jnp.where(image_mask[:, :, None, None], states, jnp.zeros((), states.dtype))
    sees_image = allowed.any(axis=(2, 3))
    everything = jnp.broadcast_to(same_document[..., None], allowed.shape)
    visible = jnp.where(sees_image[:, :, None, None], allowed, everything)
    visible = jnp.repeat(visible, num_positions(tower), axis=3).reshape(rows, tokens.shape[1], slots * per_image)
    return CrossImages(states.reshape(rows, slots * per_image, -1), visible, sees_image, same_document.any(axis=2))


def cross_masks(spec: ModelSpec, tokens: jax.Array, segment_ids: jax.Array | None, image_mask: jax.Array,
                aspect_ratio_ids: jax.Array, tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(allowed [rows, seq, slots, tiles], same_document [rows, seq, slots], tile_mask [rows, slots,
    tiles]) of a packed batch.

    `allowed` is the cross_attention_mask MllamaProcessor gives each token of its document
    (`get_cross_attention_token_mask`): an image is seen from its own image token up to the start
    of the next run of image tokens (adjacent image tokens are seen together), the document's last
    image up to the document's end, and only the tiles its arrangement holds. `same_document`: the
    slot's image is in the token's document. A token of a document with images that is allowed
    none (its text before the first image) sees all of that document's image tokens, as
    transformers' mask does; a token of a document without images is left alone by the layer, as
    transformers skips the layer for such a text."""
    from mxc.compiler.lower.vision_mllama import tile_counts

    tower = spec.vision
    slots, seq = image_mask.shape[1], tokens.shape[1]
    counts = jnp.asarray(tile_counts(tower), jnp.int32)[jnp.clip(aspect_ratio_ids, 0, tower.tiles.aspect_ratios)]
    tile_mask = (jnp.arange(tiles)[None, None, :] < counts[..., None]) & image_mask[..., None]
    segment = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    is_image = tokens == tower.entry.token
    before = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    run = jnp.cumsum((is_image & ~before).astype(jnp.int32), axis=1)  # runs of image tokens so far
    kth = jnp.where(is_image, jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1, -1)
    at = kth[:, :, None] == jnp.arange(slots)[None, None, :]  # [rows, seq, slots]: slot k's image token
    present = image_mask & at.any(axis=1)
    where = jnp.argmax(at, axis=1)  # [rows, slots]: its position
    slot_segment = jnp.take_along_axis(segment, where, axis=1)
    slot_run = jnp.take_along_axis(run, where, axis=1)
    same_document = present[:, None, :] & (segment[:, :, None] == slot_segment[:, None, :]) \
        & (segment[:, :, None] > 0)
    sees = same_document & (jnp.arange(seq)[None, :, None] >= where[:, None, :]) \
        & (run[:, :, None] == slot_run[:, None, :])
    return sees[..., None] & tile_mask[:, None], same_document, tile_mask
