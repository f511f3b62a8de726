"""Images in a training batch: a fixed number of image slots per row, and their soft tokens
placed at that row's placeholders.

    with_image_slots(spec, params, tokens, embed, pixel_values, image_mask, dtype) -> (x, image_blocks)

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
    # The text embeddings wait for the images: XLA:CPU runs independent collectives (here the
    # embedding table's gather and the tower's) in any order per device, and virtual devices
    # blocked in different orders deadlock its rendezvous.
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
