"""Llama 4's vision encoder and multi-modal projector as pure functions of a parameter tree.

An image [channels, image, image] is cut into non-overlapping patches (the towers' shared patch
embedding, here without bias), a learned class embedding joins the patches at the end, a learned
position per token is added, and a LayerNorm precedes the encoder. Every encoder layer is pre-norm
(LayerNorm with bias): bidirectional multi-head attention with biases whose queries and keys are
rotated by a 2D RoPE (patch column on the first half of each head's pairs, patch row on the second,
the class token not rotated), then a GELU MLP with biases. After a final LayerNorm the class token
is dropped, a pixel shuffle trades spatial resolution for channels (ratio 0.5: four patches become
one token of four times the width), and the adapter (two bias-free matrices, GELU after each) and
the projector (one bias-free matrix) map each token to the text model's d_model.

The numerical reference is transformers' Llama4VisionModel and Llama4MultiModalProjector.

The tower is the IR's VisionTower with rope_2d, class_token, pre_norm and a pixel_shuffle
projector. Parameters (params["vision"], from mxc.compiler.kinds.vision; kernels [in, out], heads
split out, the encoder's layers stacked on a leading axis):

    {"patches": {"kernel": [patch, patch, channels, width]},   # (row, column, channel) in a patch
     "class_embedding": [width],
     "positions": {"embedding": [patches + 1, width]},         # the class token's position is last
     "pre_norm": {"scale", "bias"},
     "layers": {"attention_norm": {"scale", "bias"},
                "attention": {"q", "k", "v": {"kernel": [layers, width, heads, head_dim], "bias"},
                              "o": {"kernel": [layers, heads, head_dim, width], "bias"}},
                "mlp_norm": {"scale", "bias"},
                "mlp": {"up": {"kernel": [layers, width, hidden], "bias"}, "down": {...}}},
     "final_norm": {"scale", "bias"},
     "projector": {"adapter": {"up": {"kernel": [width / ratio², adapter]}, "down": {"kernel": [adapter, adapter]}},
                   "kernel": [adapter, text_d_model]}}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mxc.compiler.kinds.vision import num_positions
from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.ffn import ACTIVATIONS, ffn_layer
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project
from mxc.compiler.lower.rope import apply_rope
from mxc.compiler.lower.vision import patch_embeddings
from mxc.spec.ir import ModelSpec, VisionTower


def rope_2d_angles(tower: VisionTower) -> np.ndarray:
    """[encoder tokens, head_dim // 2] rotation angles, one per adjacent pair of a head's
    dimensions (spec.ir.AxialRope): column on the first half of the pairs, row on the second (both
    counted from 1), each half over the same head_dim // 4 frequencies; the class token (last)
    keeps angle 0. HF's Llama4VisionRotaryEmbedding."""
    side = tower.patches_per_side
    quarter = tower.block.attention.head_dim // 4
    inv_freq = 1.0 / tower.rope.theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float64) / (2 * quarter))
    index = np.arange(tower.num_patches)
    column, row = index % side + 1, index // side + 1
    angles = np.concatenate([column[:, None] * inv_freq, row[:, None] * inv_freq], axis=-1)
    unrotated = np.zeros((num_positions(tower) - tower.num_patches, 2 * quarter))
    return np.concatenate([angles, unrotated]).astype(np.float32)


def pixel_shuffle(x: jax.Array, ratio: float) -> jax.Array:
    """[images, side², width] -> [images, (side·ratio)², width / ratio²]: HF's pixel_shuffle, which
    folds columns into channels, transposes, folds rows into channels and transposes back."""
    images, tokens, width = x.shape
    side = int(round(tokens ** 0.5))
    narrow, wide = int(round(side * ratio)), int(round(width / ratio))
    x = x.reshape(images, side, narrow, wide).transpose(0, 2, 1, 3)
    x = x.reshape(images, narrow, narrow, int(round(width / ratio ** 2))).transpose(0, 2, 1, 3)
    return x.reshape(images, narrow * narrow, -1)


def _encoder_layer(tower: VisionTower, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    block, dtype = tower.block, x.dtype
    h = apply_norm(block.norm, params["attention_norm"], x)
    q, k, v = (project(h, params["attention"][name], "bse,ehd->bshd", dtype) for name in ("q", "k", "v"))
    q, k = apply_rope(q, cos, sin, interleaved=True), apply_rope(k, cos, sin, interleaved=True)
    # Every token sees every other: equal positions make the causal core's mask all true.
    same = jnp.zeros(x.shape[:2], jnp.int32)
    context = attend(q, k, v, q_positions=same, kv_positions=same, scale=block.attention.head_dim ** -0.5)
    x = x + project(context, params["attention"]["o"], "bshd,hde->bse", dtype)
    return x + ffn_layer(block.mlp, params["mlp"], apply_norm(block.norm, params["mlp_norm"], x))


def adapter_output(tower: VisionTower, vp: dict, pixels: jax.Array, dtype, remat_policy=None) -> jax.Array:
    """pixels [images, channels, image, image] -> [images, tokens_per_image, adapter], before the
    projector (HF's Llama4VisionModel last_hidden_state); vp is params["vision"]."""
    x = patch_embeddings(tower, vp["patches"], pixels, dtype)
    if tower.class_token:
        cls = jnp.broadcast_to(vp["class_embedding"].astype(dtype), (x.shape[0], 1, tower.d_model))
        x = jnp.concatenate([x, cls], axis=1)
    x = x + vp["positions"]["embedding"].astype(dtype)
    if tower.pre_norm is not None:
        x = apply_norm(tower.pre_norm, vp["pre_norm"], x)
    angles = jnp.asarray(rope_2d_angles(tower))[None]
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def step(x, layer):
        return _encoder_layer(tower, layer, x, cos, sin), None

    if remat_policy is not None:  # training: the text model's policy, as for SigLIP (vision._encoder)
        step = jax.checkpoint(step, policy=remat_policy, prevent_cse=False)
    x, _ = jax.lax.scan(step, x, vp["layers"])
    x = apply_norm(tower.final_norm, vp["final_norm"], x)[:, :tower.num_patches]  # the class token leaves
    projector = tower.projector
    x = pixel_shuffle(x, projector.ratio)
    for name in ("up", "down"):
        x = ACTIVATIONS[projector.act](project(x, vp["projector"]["adapter"][name], "...i,io->...o", dtype, mlp=True))
    return x


def encode_images(spec: ModelSpec, params: dict, pixels: jax.Array, dtype, remat_policy=None) -> jax.Array:
    """pixels [images, channels, image, image] -> [images, tokens_per_image, d_model] in dtype: what
    replaces the image placeholder tokens' embeddings in the text model."""
    vp = params["vision"]
    x = adapter_output(spec.vision, vp, pixels, dtype, remat_policy)
    return project(x, {"kernel": vp["projector"]["kernel"]}, "...i,io->...o", dtype)
