"""Llama 4's vision encoder and multi-modal projector as pure functions of a parameter tree.

An image [channels, image, image] is cut into non-overlapping patches (an unfold and one matrix,
no bias), a learned class embedding joins the patches at the end, a learned position per token
is added, and a LayerNorm precedes the encoder. Every encoder layer is pre-norm (LayerNorm with
bias): bidirectional multi-head attention with biases whose queries and keys are rotated by a 2D
RoPE (patch column on the first half of each head's pairs, patch row on the second, the class
token not rotated), then a GELU MLP with biases. After a final LayerNorm the class token is
dropped, a pixel shuffle trades spatial resolution for channels (ratio 0.5: four patches become
one token of four times the width), and the adapter (two bias-free matrices, GELU after each)
and the projector (one bias-free matrix) map each token to the text model's d_model.

The numerical reference is transformers' Llama4VisionModel and Llama4MultiModalProjector.

Parameters (kernels [in, out], heads split out; the encoder's layers stacked on a leading axis;
the same layout as the other vision towers, mxc.compiler.kinds.vision):

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

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.param_def import UnsupportedError, linear, map_defs, matrix, norm_defs
from mxc.compiler.lower.projection import project
from mxc.compiler.lower.rope import apply_rope
from mxc.spec.ir import LayerNorm


@dataclass(frozen=True)
class Llama4Vision:
    """The sizes of one Llama 4 vision tower (HF's Llama4VisionConfig names in comments)."""

    image: int  # image_size: side of the square input, in pixels
    patch: int  # patch_size
    channels: int  # num_channels
    width: int  # hidden_size
    heads: int  # num_attention_heads
    hidden: int  # intermediate_size: the encoder MLP's width
    layers: int  # num_hidden_layers
    norm_eps: float  # norm_eps
    rope_theta: float  # rope_parameters.rope_theta
    shuffle_ratio: float  # pixel_shuffle_ratio
    adapter: int  # projector_input_dim = projector_output_dim = vision_output_dim
    text_d_model: int  # the text model's hidden_size

    def __post_init__(self):
        side = self.patches_per_side
        shuffled = side * self.shuffle_ratio
        if self.image % self.patch:
            raise UnsupportedError(f"image {self.image} is not a whole number of {self.patch}-pixel patches")
        if self.width % self.heads or self.head_dim % 4:
            raise UnsupportedError(f"width {self.width} over {self.heads} heads: the 2D RoPE needs a head size "
                                   "divisible by 4")
        if shuffled != int(shuffled) or self.width / self.shuffle_ratio ** 2 != self.shuffled_width:
            raise UnsupportedError(f"pixel shuffle ratio {self.shuffle_ratio} does not divide {side} patches per "
                                   f"side and width {self.width} evenly")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def patches_per_side(self) -> int:
        return self.image // self.patch

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def shuffled_width(self) -> int:
        return int(round(self.width / self.shuffle_ratio ** 2))

    @property
    def tokens_per_image(self) -> int:
        return int(round(self.num_patches * self.shuffle_ratio ** 2))

    @property
    def norm(self) -> LayerNorm:
        return LayerNorm(eps=self.norm_eps)


def param_defs(v: Llama4Vision) -> dict:
    """The tower's and projector's ParamDef tree (layout in the module docstring)."""
    w, heads, hd = v.width, v.heads, v.head_dim
    layer = {"attention_norm": norm_defs(v.norm, w, "embed"),
             "attention": {name: linear((w,), ("embed",), (heads, hd), ("heads", "head_dim"), True)
                           for name in ("q", "k", "v")},
             "mlp_norm": norm_defs(v.norm, w, "embed"),
             "mlp": {"up": linear((w,), ("embed",), (v.hidden,), ("mlp",), True),
                     "down": linear((v.hidden,), ("mlp",), (w,), ("embed",), True)}}
    layer["attention"]["o"] = linear((heads, hd), ("heads", "head_dim"), (w,), ("embed",), True)
    # The projector's and adapter's inputs are unnamed so that no matrix asks twice for one mesh axis.
    return {"patches": {"kernel": matrix((v.patch, v.patch, v.channels, w), (None, None, None, "embed"))},
            "class_embedding": matrix((w,), ("embed",)),
            "positions": {"embedding": matrix((v.num_patches + 1, w), (None, "embed"))},
            "pre_norm": norm_defs(v.norm, w, "embed"),
            "layers": map_defs(lambda p: p.stacked(v.layers), layer),
            "final_norm": norm_defs(v.norm, w, "embed"),
            "projector": {"adapter": {"up": {"kernel": matrix((v.shuffled_width, v.adapter), (None, "mlp"))},
                                      "down": {"kernel": matrix((v.adapter, v.adapter), ("mlp", None))}},
                          "kernel": matrix((v.adapter, v.text_d_model), (None, "embed"))}}


def rope_2d_angles(v: Llama4Vision) -> np.ndarray:
    """[patches + 1, head_dim // 2] rotation angles, one per adjacent pair of a head's dimensions:
    the first half of the pairs turn with the patch's column, the second half with its row (both
    counted from 1), each half over the same head_dim // 4 frequencies; the class token (last) is
    not rotated. HF's Llama4VisionRotaryEmbedding, the axial RoPE Pixtral also uses."""
    side = v.patches_per_side
    quarter = v.head_dim // 4
    inv_freq = 1.0 / v.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float64) / (2 * quarter))
    index = np.arange(v.num_patches)
    column, row = index % side + 1, index // side + 1
    angles = np.concatenate([column[:, None] * inv_freq, row[:, None] * inv_freq], axis=-1)
    return np.concatenate([angles, np.zeros((1, 2 * quarter))]).astype(np.float32)


def unfold_patches(pixels: jax.Array, patch: int) -> jax.Array:
    """[images, channels, H, W] -> [images, patches, patch · patch · channels], patches in row-major
    order and each patch's values in (row, column, channel) order (torch's Unfold takes channel,
    row, column: the HF map reorders the matrix's rows instead of the pixels)."""
    images, channels, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    x = pixels.reshape(images, channels, rows, patch, cols, patch)
    return x.transpose(0, 2, 4, 3, 5, 1).reshape(images, rows * cols, patch * patch * channels)


def pixel_shuffle(x: jax.Array, ratio: float) -> jax.Array:
    """[images, side², width] -> [images, (side·ratio)², width / ratio²]: HF's pixel_shuffle, which
    folds columns into channels, transposes, folds rows into channels and transposes back."""
    images, tokens, width = x.shape
    side = int(round(tokens ** 0.5))
    narrow, wide = int(round(side * ratio)), int(round(width / ratio))
    x = x.reshape(images, side, narrow, wide).transpose(0, 2, 1, 3)
    x = x.reshape(images, narrow, narrow, int(round(width / ratio ** 2))).transpose(0, 2, 1, 3)
    return x.reshape(images, narrow * narrow, -1)


def _encoder_layer(v: Llama4Vision, params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    dtype = x.dtype
    h = apply_norm(v.norm, params["attention_norm"], x)
    q, k, val = (project(h, params["attention"][name], "bse,ehd->bshd", dtype) for name in ("q", "k", "v"))
    q, k = apply_rope(q, cos, sin, interleaved=True), apply_rope(k, cos, sin, interleaved=True)
    # Every token sees every other: equal positions make the causal core's mask all true.
    same = jnp.zeros(x.shape[:2], jnp.int32)
    context = attend(q, k, val, q_positions=same, kv_positions=same, scale=v.head_dim ** -0.5)
    x = x + project(context, params["attention"]["o"], "bshd,hde->bse", dtype)
    h = apply_norm(v.norm, params["mlp_norm"], x)
    h = jax.nn.gelu(project(h, params["mlp"]["up"], "...i,io->...o", dtype, mlp=True), approximate=False)
    return x + project(h, params["mlp"]["down"], "...i,io->...o", dtype, mlp=True)


def encode_images(v: Llama4Vision, params: dict, pixels: jax.Array) -> jax.Array:
    """pixels [images, channels, image, image] -> the adapter's output [images, tokens_per_image,
    adapter] (HF's Llama4VisionModel last_hidden_state), in pixels' dtype."""
    if pixels.shape[1:] != (v.channels, v.image, v.image):
        raise ValueError(f"pixel values {pixels.shape}: expected [images, {v.channels}, {v.image}, {v.image}]")
    dtype = pixels.dtype
    kernel = params["patches"]["kernel"]
    x = project(unfold_patches(pixels, v.patch), {"kernel": kernel.reshape(-1, v.width)}, "...i,io->...o", dtype)
    cls = jnp.broadcast_to(params["class_embedding"].astype(dtype), (x.shape[0], 1, v.width))
    x = jnp.concatenate([x, cls], axis=1) + params["positions"]["embedding"].astype(dtype)
    x = apply_norm(v.norm, params["pre_norm"], x)
    angles = jnp.asarray(rope_2d_angles(v))[None]
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def step(x, layer):
        return _encoder_layer(v, layer, x, cos, sin), None

    x, _ = jax.lax.scan(step, x, params["layers"])
    x = apply_norm(v.norm, params["final_norm"], x)[:, :-1]  # the class token leaves here
    x = pixel_shuffle(x, v.shuffle_ratio)
    for name in ("up", "down"):
        x = jax.nn.gelu(project(x, params["projector"]["adapter"][name], "...i,io->...o", dtype, mlp=True),
                        approximate=False)
    return x


def image_embeddings(v: Llama4Vision, params: dict, pixels: jax.Array) -> jax.Array:
    """pixels [images, channels, image, image] -> [images, tokens_per_image, text_d_model]: what
    replaces the image placeholder tokens' embeddings in the text model."""
    projector = {"kernel": params["projector"]["kernel"]}
    return project(encode_images(v, params, pixels), projector, "...i,io->...o", pixels.dtype)
