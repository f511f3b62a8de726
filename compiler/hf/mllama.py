"""Llama 3.2 Vision (model_type mllama, MllamaForConditionalGeneration): HF tensor names <-> the
vision tower's and projector's parameters (layout in mxc.compiler.lower.vision_mllama).

transformers' module tree names the tower `model.vision_model.*` and the projector
`model.multi_modal_projector.*`; save_pretrained files on the hub drop the leading `model.`.
Every conversion is a transpose or a reshape, so reading and writing are exact inverses.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from mxc.compiler.hf.mapping import TensorMap, _heads_in, _heads_out, _same, _transpose
from mxc.compiler.lower.vision_mllama import MllamaTower


def _scalar():
    # HF's gates are [1]; mxc's a scalar.
    return (lambda g: g.reshape(()), lambda g: g.reshape(1))


def _patches(tower: MllamaTower):
    # HF Conv2d [width, channel, row, column] <-> mxc [row, column, channel, width] (HWIO)
    return (lambda w: w.transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))


def _aspect_table(tower: MllamaTower, tokens: int | None):
    # HF [ids, tiles · (tokens ·) width] <-> mxc [ids, tiles, (tokens,) width]
    inner = (tower.tiles, tower.width) if tokens is None else (tower.tiles, tokens, tower.width)
    return (lambda w: w.reshape(w.shape[0], *inner), lambda t: t.reshape(t.shape[0], -1))


def _layernorm(hf: str, path: tuple, layer=None) -> Iterator[TensorMap]:
    yield TensorMap(hf + ".weight", path + ("scale",), layer, _same, _same)
    yield TensorMap(hf + ".bias", path + ("bias",), layer, _same, _same)


def _encoder(tower: MllamaTower, hf: str, path: tuple, count: int, gated: bool) -> Iterator[TensorMap]:
    heads, head_dim = tower.heads, tower.width // tower.heads
    for i in range(count):
        layer = f"{hf}.layers.{i}."
        yield from _layernorm(layer + "input_layernorm", path + ("attention_norm",), i)
        yield from _layernorm(layer + "post_attention_layernorm", path + ("mlp_norm",), i)
        for proj in ("q", "k", "v"):
            yield TensorMap(layer + f"self_attn.{proj}_proj.weight", path + ("attention", proj, "kernel"), i,
                            *_heads_in(heads, head_dim))
        yield TensorMap(layer + "self_attn.o_proj.weight", path + ("attention", "o", "kernel"), i,
                        *_heads_out(heads, head_dim))
        for fc, proj in (("fc1", "up"), ("fc2", "down")):
            yield TensorMap(layer + f"mlp.{fc}.weight", path + ("mlp", proj, "kernel"), i, _transpose, _transpose)
            yield TensorMap(layer + f"mlp.{fc}.bias", path + ("mlp", proj, "bias"), i, _same, _same)
        if gated:
            yield TensorMap(layer + "gate_attn", path + ("attention_gate",), i, *_scalar())
            yield TensorMap(layer + "gate_ffn", path + ("mlp_gate",), i, *_scalar())


def vision_tensor_maps(tower: MllamaTower, prefix: str = "model.") -> Iterator[TensorMap]:
    """The tower's and projector's tensors (under params["vision"]); prefix "model." for
    transformers' module tree, "" for save_pretrained files."""
    base, hf = ("vision",), prefix + "vision_model."
    yield TensorMap(hf + "patch_embedding.weight", base + ("patches", "kernel"), None, *_patches(tower))
    yield TensorMap(hf + "class_embedding", base + ("class_embedding",), None, _same, _same)
    positions = hf + "gated_positional_embedding."
    yield TensorMap(positions + "embedding", base + ("positions", "embedding"), None, _same, _same)
    yield TensorMap(positions + "gate", base + ("positions", "gate"), None, *_scalar())
    yield TensorMap(positions + "tile_embedding.weight", base + ("positions", "tile_embedding"), None,
                    *_aspect_table(tower, tower.tokens))
    for hf_name, name in (("pre_tile_positional_embedding", "pre_tile"), ("post_tile_positional_embedding", "post_tile")):
        yield TensorMap(f"{hf}{hf_name}.embedding.weight", base + (name, "embedding"), None,
                        *_aspect_table(tower, None))
        yield TensorMap(f"{hf}{hf_name}.gate", base + (name, "gate"), None, *_scalar())
    yield from _layernorm(hf + "layernorm_pre", base + ("pre_norm",))
    yield from _layernorm(hf + "layernorm_post", base + ("final_norm",))
    yield from _encoder(tower, hf + "transformer", base + ("layers",), tower.layers, gated=False)
    yield from _encoder(tower, hf + "global_transformer", base + ("global_layers",), tower.global_layers, gated=True)
    projector = prefix + "multi_modal_projector."
    yield TensorMap(projector + "weight", base + ("projector", "kernel"), None, _transpose, _transpose)
    yield TensorMap(projector + "bias", base + ("projector", "bias"), None, _same, _same)


def params_from_state(maps, state: dict) -> dict:
    """Build a parameter tree from HF tensors (numpy), stacking per-layer tensors on a leading axis."""
    leaves: dict[tuple, dict] = {}
    for tensor_map in maps:
        value = tensor_map.to_mxc(np.asarray(state[tensor_map.hf_name]))
        leaves.setdefault(tensor_map.path, {})[tensor_map.layer] = value
    tree: dict = {}
    for path, by_layer in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = by_layer[None] if None in by_layer else np.stack([by_layer[i] for i in sorted(by_layer)])
    return tree
