"""Llama 3.2 Vision's (mllama's) image encoder and multi-modal projector as pure functions of a
parameter tree.

An image arrives as up to `tiles` square tiles (the processor's split of a large image) with an
aspect-ratio id that says how the tiles are laid out. Each tile is cut into patches (a bias-free
convolution); a learned, tanh-gated embedding per (aspect ratio, tile) is added before a class
token is put in front of each tile's patches; then the learned positions, gated by 1 - tanh(g), and
per (aspect ratio, tile, position) embeddings gated by tanh(g); a LayerNorm. Every tile is padded
to a multiple of 8 tokens and the tiles of one image run through the local encoder together as one
sequence (plain pre-norm layers), whose chosen intermediate outputs are kept; after a LayerNorm and
a second gated aspect-ratio embedding, the global encoder (the same layers with tanh gates on their
attention and MLP outputs) runs over the same sequence. The output per token is the global
encoder's output followed by the kept intermediate outputs, interleaved feature by feature
(transformers stacks them on a last axis and flattens), and one biased matrix maps it to the text
model's d_model: the keys and values of the text model's cross-attention layers.

The attention mask is transformers' (`_prepare_aspect_ratio_attention_mask`): a token counts as
padding when it is one of the padded positions or in a tile the aspect-ratio mask drops, and only a
query and a key that are both padding are kept apart: real tokens see the padding too.

The numerical reference is transformers' MllamaVisionModel and MllamaModel.multi_modal_projector.
The tower is the IR's VisionTower with tiles, global_layers, intermediate and a linear projector.
Parameters (params["vision"], from mxc.compiler.kinds.vision; kernels [in, out], heads split out,
encoder layers stacked on a leading axis):

    {"patches": {"kernel": [patch, patch, channels, width]},
     "class_embedding": [width],
     "positions": {"embedding": [tokens, width], "gate": [],
                   "tile_embedding": [aspect_ratio_ids, tiles, tokens, width]},    # tokens = patches + 1
     "pre_tile": {"embedding": [aspect_ratio_ids, tiles, width], "gate": []},
     "post_tile": {"embedding": [aspect_ratio_ids, tiles, width], "gate": []},
     "pre_norm": {"scale", "bias"}, "final_norm": {"scale", "bias"},
     "layers" and "global_layers": {"attention_norm": {"scale", "bias"},
                "attention": {"q", "k", "v": {"kernel": [layers, width, heads, head_dim]},
                              "o": {"kernel": [layers, heads, head_dim, width]}},
                "mlp_norm": {"scale", "bias"},
                "mlp": {"up": {"kernel": [layers, width, hidden], "bias"}, "down": {...}},
                "attention_gate": [layers], "mlp_gate": [layers]},               # global layers only
     "projector": {"kernel": [width * (1 + len(intermediate)), text_d_model], "bias"}}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.ffn import ffn_layer
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project
from mxc.compiler.kinds.vision import num_positions, output_width
from mxc.compiler.lower.vision import patch_embeddings
from mxc.spec.ir import VisionTower

PAD_MULTIPLE = 8  # transformers pads each tile's tokens to a multiple of 8


def tile_counts(tower: VisionTower) -> tuple[int, ...]:
    """How many tiles each aspect-ratio id stands for (0 for id 0, no image): the processor's
    arrangements of up to `max` tiles, in its order (MllamaImageProcessor's supported aspect ratios)."""
    most = tower.tiles.max
    return (0,) + tuple(w * h for w in range(1, most + 1) for h in range(1, most + 1) if w * h <= most)


def padded_tokens(tower: VisionTower) -> int:
    return -(-num_positions(tower) // PAD_MULTIPLE) * PAD_MULTIPLE


def padding_positions(tower: VisionTower, aspect_ratio_mask: jax.Array) -> jax.Array:
    """[images, tiles] 0/1 -> [images, tiles * padded_tokens] booleans: transformers' padding,
    the padded positions of every tile and every token of a dropped tile. (Some position is
    always padded: a square plus one is never a multiple of 8.)"""
    padded_position = jnp.arange(padded_tokens(tower)) >= num_positions(tower)
    dropped = aspect_ratio_mask[:, :, None] == 0
    return (dropped | padded_position[None, None, :]).reshape(aspect_ratio_mask.shape[0], -1)


def _encoder_layer(tower: VisionTower, params: dict, x: jax.Array, q_positions, kv_positions,
                   gated: bool) -> jax.Array:
    block, dtype = tower.block, x.dtype
    h = apply_norm(block.norm, params["attention_norm"], x)
    q, k, v = (project(h, params["attention"][name], "bse,ehd->bshd", dtype) for name in ("q", "k", "v"))
    context = attend(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                     scale=block.attention.head_dim ** -0.5)
    out = project(context, params["attention"]["o"], "bshd,hde->bse", dtype)
    if gated:
        out = jnp.tanh(params["attention_gate"]).astype(dtype) * out
    x = x + out
    out = ffn_layer(block.mlp, params["mlp"], apply_norm(block.norm, params["mlp_norm"], x))
    if gated:
        out = jnp.tanh(params["mlp_gate"]).astype(dtype) * out
    return x + out


def _aspect_embedding(params: dict, aspect_ratio_ids: jax.Array, dtype) -> jax.Array:
    """[images] -> [images, tiles, 1, width], gated by tanh(gate)."""
    table = params["embedding"][aspect_ratio_ids].astype(dtype)
    return (jnp.tanh(params["gate"]).astype(dtype) * table)[:, :, None, :]


def encode_tiles(tower: VisionTower, vp: dict, pixel_values: jax.Array, aspect_ratio_ids: jax.Array,
                 aspect_ratio_mask: jax.Array, dtype, remat_policy=None) -> jax.Array:
    """pixel_values [images, tiles, channels, image, image], aspect_ratio_ids [images],
    aspect_ratio_mask [images, tiles] -> [images, tiles, tokens, output_width]: transformers'
    MllamaVisionModel last_hidden_state (per image; the batch axis folded into images). With a
    remat_policy (training) each encoder layer is rematerialised under it, as the text's layers are:
    an image's attention probabilities (tiles x 1608 tokens squared per head at 560 pixels) would
    otherwise be kept for every layer's backward pass."""
    images, tiles = pixel_values.shape[:2]
    width, tokens, padded = tower.d_model, num_positions(tower), padded_tokens(tower)
    x = patch_embeddings(tower, vp["patches"], pixel_values.reshape(images * tiles, *pixel_values.shape[2:]), dtype)
    x = x.reshape(images, tiles, tokens - 1, width) + _aspect_embedding(vp["pre_tile"], aspect_ratio_ids, dtype)
    cls = jnp.broadcast_to(vp["class_embedding"].astype(dtype), (images, tiles, 1, width))
    x = jnp.concatenate([cls, x], axis=2)
    positions = vp["positions"]
    gate = jnp.tanh(positions["gate"]).astype(dtype)
    x = x + (1 - gate) * positions["embedding"].astype(dtype)
    x = x + gate * positions["tile_embedding"][aspect_ratio_ids].astype(dtype)
    x = apply_norm(tower.pre_norm, vp["pre_norm"], x)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, padded - tokens), (0, 0))).reshape(images, tiles * padded, width)

    # A query may see a key unless both are padding: causal visibility over two levels does it,
    # real queries at 1 see every key, padding queries at 0 see only real keys (at 0).
    padding = padding_positions(tower, aspect_ratio_mask)
    q_positions = jnp.where(padding, 0, 1).astype(jnp.int32)
    kv_positions = jnp.where(padding, 1, 0).astype(jnp.int32)

    def local(x, layer):
        x = _encoder_layer(tower, layer, x, q_positions, kv_positions, gated=False)
        return x, x

    def global_(x, layer):
        return _encoder_layer(tower, layer, x, q_positions, kv_positions, gated=True), None

    if remat_policy is not None:
        local = jax.checkpoint(local, policy=remat_policy, prevent_cse=False)
        global_ = jax.checkpoint(global_, policy=remat_policy, prevent_cse=False)

    x, every_output = jax.lax.scan(local, x, vp["layers"])
    kept = every_output[jnp.asarray(tower.intermediate)]  # [kept, images, tiles * padded, width]
    x = apply_norm(tower.final_norm, vp["final_norm"], x)
    x = x.reshape(images, tiles, padded, width) + _aspect_embedding(vp["post_tile"], aspect_ratio_ids, dtype)
    x = x.reshape(images, tiles * padded, width)
    x, _ = jax.lax.scan(global_, x, vp["global_layers"])
    # transformers stacks the kept outputs on a last axis: feature-major, layer-minor.
    kept = jnp.moveaxis(kept, 0, -1).reshape(images, tiles * padded, width * len(tower.intermediate))
    out = jnp.concatenate([x, kept], axis=-1).reshape(images, tiles, padded, output_width(tower))
    return out[:, :, :tokens]


def project_tiles(vp: dict, features: jax.Array, dtype) -> jax.Array:
    """[images, tiles, tokens, output_width] -> [images, tiles * tokens, text d_model]: the keys'
    and values' source for the text model's cross-attention layers, an image's tiles in order."""
    out = project(features, vp["projector"], "...i,io->...o", dtype)
    return out.reshape(out.shape[0], -1, out.shape[-1])
