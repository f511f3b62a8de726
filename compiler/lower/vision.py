"""The vision tower's lowering: images to soft tokens, and those tokens into the text embeddings.

    encode_images(spec, params, pixel_values, dtype) -> [images, tokens_per_image, d_model]
    with_images(spec, params, tokens, x, pixel_values, token_type_ids) -> (x, image_blocks)

pixel_values are [images, channels, height, width] as HF processors produce them. The encoder
layers are the text model's block lowering, scanned over the stacked layers, with every patch
of an image attending to every other (one image block per image). Parameters: kinds/vision.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.block import block_layer
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project
from mxc.spec.ir import LearnedPositions, ModelSpec, PixelShuffleProjector, PooledProjector


def patch_embeddings(tower, params: dict, pixel_values: jax.Array, dtype) -> jax.Array:
    """[images, channels, H, W] -> [images, patches, width], patches in row-major grid order."""
    images = jnp.transpose(pixel_values.astype(dtype), (0, 2, 3, 1))  # NHWC
    kernel = params["kernel"].astype(dtype)  # [size, size, channels, width]: HWIO
    out = jax.lax.conv_general_dilated(images, kernel, (tower.patches.stride,) * 2, "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       preferred_element_type=jnp.float32)
    if "bias" in params:
        out = out + params["bias"].astype(jnp.float32)
    n, rows, cols, width = out.shape
    return out.reshape(n, rows * cols, width).astype(dtype)


def _encoder(tower, params: dict, x: jax.Array, remat_policy=None) -> jax.Array:
    n, patches, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(patches, dtype=jnp.int32), (n, patches))
    whole_image = jnp.zeros((n, patches), jnp.int32)  # one block: bidirectional over the image

    def body(x, layer_params):
        x, _ = block_layer(tower.block, layer_params, x, positions, image_blocks=whole_image)
        return x, None

    if remat_policy is not None:  # training: the text model's policy, as for its own layers
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params)
    return x


def _pooled_projection(spec: ModelSpec, projector: PooledProjector, params: dict, x: jax.Array) -> jax.Array:
    """Gemma 3: average k x k patches of the grid into one soft token, normalise, project."""
    n, patches, width = x.shape
    side = spec.vision.patches_per_side
    out_side = int(round(projector.tokens ** 0.5))
    k = side // out_side
    grid = x.astype(jnp.float32).reshape(n, out_side, k, out_side, k, width)
    pooled = grid.mean(axis=(2, 4)).reshape(n, out_side * out_side, width).astype(x.dtype)
    normed = apply_norm(projector.norm, params["norm"], pooled)
    return project(normed, {key: v for key, v in params.items() if key != "norm"}, "bte,ed->btd", x.dtype)


def encode_images(spec: ModelSpec, params: dict, pixel_values: jax.Array, dtype, remat_policy=None) -> jax.Array:
    """The soft tokens of each image: [images, tokens_per_image, d_model] in dtype."""
    tower, vp = spec.vision, params["vision"]
    if tower.tiles is not None:
        raise NotImplementedError("Llama 3.2 Vision's images enter through its cross-attention layers "
                                  "(compiler/lower/cross_attention.py), not as soft tokens; training with them "
                                  "is not built")
    if isinstance(tower.projector, PixelShuffleProjector):  # Llama 4: class token, 2D RoPE, pixel shuffle
        from mxc.compiler.lower import vision_llama4

        return vision_llama4.encode_images(spec, params, pixel_values, dtype, remat_policy)
    x = patch_embeddings(tower, vp["patches"], pixel_values, dtype)
    if isinstance(tower.positions, LearnedPositions):
        x = x + vp["positions"]["embedding"].astype(dtype)[None]
    x = _encoder(tower, vp["layers"], x, remat_policy)
    if tower.final_norm is not None:
        x = apply_norm(tower.final_norm, vp["final_norm"], x)
    return _pooled_projection(spec, tower.projector, vp["projector"], x)


def image_blocks(is_image: jax.Array) -> jax.Array:
    """[batch, seq] bool -> each token's image within its row (0, 1, ... per contiguous run of image
    tokens), -1 for text: HF's get_block_sequence_ids_for_mask."""
    before = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = is_image & ~before
    return jnp.where(is_image, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1)


def with_images(spec: ModelSpec, params: dict, tokens: jax.Array, x: jax.Array, pixel_values: jax.Array,
                token_type_ids: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """x with the placeholders' embeddings replaced by the images' soft tokens (the k-th placeholder
    in row-major order takes the k-th soft token), and the image blocks for the mask (None where
    the entry keeps images causal)."""
    if spec.vision is None:
        raise ValueError(f"{spec.name} has no vision tower; it takes no images")
    entry = spec.vision.entry
    features = encode_images(spec, params, pixel_values, x.dtype)
    features = features.reshape(-1, features.shape[-1])
    placeholder = tokens == entry.token
    index = jnp.cumsum(placeholder.reshape(-1).astype(jnp.int32)).reshape(tokens.shape) - 1
    gathered = jnp.take(features, jnp.clip(index, 0, features.shape[0] - 1), axis=0)
    x = jnp.where(placeholder[..., None], gathered, x)
    if not entry.bidirectional:
        return x, None
    is_image = placeholder if token_type_ids is None else token_type_ids == 1
    return x, image_blocks(is_image)
