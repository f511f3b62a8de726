"""Llama 3.2 Vision (model_type mllama, MllamaForConditionalGeneration): HF tensor names <-> the
vision tower's and projector's parameters (layout in mxc.compiler.lower.vision_mllama).

transformers' module tree names the tower `model.vision_model.*` and the projector
`model.multi_modal_projector.*`; save_pretrained files on the hub drop the leading `model.`.
Every conversion is a transpose or a reshape, so reading and writing are exact inverses.

The text model is Llama's under `language_model.` (hub files: `language_model.model.layers.N.*`,
`language_model.lm_head.weight`); a cross-attention layer has `cross_attn.{q,k,v,o}_proj`,
`cross_attn.{q,k}_norm`, `cross_attn_attn_gate` and `cross_attn_mlp_gate` where a Llama layer has
`self_attn.*`. transformers' module tree (`model.language_model.*`, `model.vision_model.*`,
`lm_head.weight`) is read too (canonical_names).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from mxc.compiler.hf.config_in import ConfigError, config_dtype, dense_spec_from_config, segments, square_size
from mxc.compiler.hf.families import FamilyConverter
from mxc.compiler.hf.mapping import (LayoutError, TensorMap, _heads_in, _heads_out, _same, _transpose, attention_maps, layer_entry,
                                     norm_maps, top_level_maps)
from mxc.compiler.lower.params import layer_slots
from mxc.compiler.kinds.vision import num_positions
from mxc.spec.ir import (MHA, MLP, Block, CrossAttention, CrossAttentionEntry, EncoderBlock, LayerNorm,
                         LearnedPositions, LinearProjector, ModelSpec, Patches, RMSNorm, Segment, Tiles, VisionTower)

ARCHITECTURES = {"mllama": "MllamaForConditionalGeneration"}
EXTRA_ROWS = 8  # MllamaTextModel's embed_tokens has vocab_size + 8 rows

# MllamaVisionConfig's default arrangements of up to four tiles.
ASPECT_RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
IMAGE_TOKEN = 128256  # MllamaConfig's image_token_index


def tower_from_config(cfg: dict) -> VisionTower:
    """An MllamaConfig (dict) -> its vision tower; what mxc cannot express is a ConfigError."""
    vision_cfg = cfg.get("vision_config") or {}

    def size(key, default):
        return square_size(vision_cfg, key, default, "mxc's Llama 3.2 Vision tower takes square tiles")

    act = vision_cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(f"vision_config.hidden_act '{act}': mxc reads Llama 3.2 Vision's gelu only")
    width = size("hidden_size", 1280)
    heads = vision_cfg.get("attention_heads", vision_cfg.get("num_attention_heads", 16))
    intermediate = tuple(vision_cfg.get("intermediate_layers_indices") or (3, 7, 15, 23, 30))
    output = vision_cfg.get("vision_output_dim", 7680)
    if output != width * (1 + len(intermediate)):
        raise ConfigError(f"vision_config.vision_output_dim {output} must be hidden_size x (1 + "
                          f"len(intermediate_layers_indices)) = {width * (1 + len(intermediate))}")
    patch = size("patch_size", 14)
    outer = LayerNorm(eps=1e-5)  # transformers' layernorm_pre/post keep nn.LayerNorm's eps
    return VisionTower(
        image=size("image_size", 448), d_model=width,
        patches=Patches(size=patch, stride=patch, channels=vision_cfg.get("num_channels", 3), bias=False),
        positions=LearnedPositions(),
        block=EncoderBlock(attention=MHA(heads=heads, head_dim=width // heads, rope=None),
                           mlp=MLP(hidden=vision_cfg.get("intermediate_size", 5120), act="gelu", bias=True),
                           norm=LayerNorm(eps=vision_cfg.get("norm_eps", 1e-5))),
        layers=vision_cfg.get("num_hidden_layers", 32), final_norm=outer, projector=LinearProjector(),
        entry=CrossAttentionEntry(token=cfg.get("image_token_index", IMAGE_TOKEN)),
        class_token=True, pre_norm=outer,
        tiles=Tiles(max=vision_cfg.get("max_num_tiles", 4),
                    aspect_ratios=len(vision_cfg.get("supported_aspect_ratios") or ASPECT_RATIOS)),
        global_layers=vision_cfg.get("num_global_layers", 8), intermediate=intermediate)


def _scalar():
    # HF's gates are [1]; mxc's a scalar.
    return (lambda g: g.reshape(()), lambda g: g.reshape(1))


def _gate(hf_name: str, path: tuple, layer: int) -> TensorMap:
    # A stacked layer's scalar gate: a one-element slice of the stack, so that writing it lands in place.
    return TensorMap(hf_name, path, slice(layer, layer + 1), _same, _same)


def _patches(tower: VisionTower):
    # HF Conv2d [width, channel, row, column] <-> mxc [row, column, channel, width] (HWIO)
    return (lambda w: w.transpose(2, 3, 1, 0), lambda k: k.transpose(3, 2, 0, 1))


def _aspect_table(tower: VisionTower, tokens: int | None):
    # HF [ids, tiles · (tokens ·) width] <-> mxc [ids, tiles, (tokens,) width]
    tiles, width = tower.tiles.max, tower.d_model
    inner = (tiles, width) if tokens is None else (tiles, tokens, width)
    return (lambda w: w.reshape(w.shape[0], *inner), lambda t: t.reshape(t.shape[0], -1))


def _layernorm(hf: str, path: tuple, layer=None) -> Iterator[TensorMap]:
    yield TensorMap(hf + ".weight", path + ("scale",), layer, _same, _same)
    yield TensorMap(hf + ".bias", path + ("bias",), layer, _same, _same)


def _encoder(tower: VisionTower, hf: str, path: tuple, count: int, gated: bool) -> Iterator[TensorMap]:
    heads, head_dim = tower.block.attention.heads, tower.block.attention.head_dim
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
            yield _gate(layer + "gate_attn", path + ("attention_gate",), i)
            yield _gate(layer + "gate_ffn", path + ("mlp_gate",), i)


def vision_tensor_maps(tower: VisionTower, prefix: str = "") -> Iterator[TensorMap]:
    """The tower's and projector's tensors (under params["vision"]); prefix "" for the hub's
    files, "model." for transformers' module tree."""
    base, hf = ("vision",), prefix + "vision_model."
    yield TensorMap(hf + "patch_embedding.weight", base + ("patches", "kernel"), None, *_patches(tower))
    yield TensorMap(hf + "class_embedding", base + ("class_embedding",), None, _same, _same)
    positions = hf + "gated_positional_embedding."
    yield TensorMap(positions + "embedding", base + ("positions", "embedding"), None, _same, _same)
    yield TensorMap(positions + "gate", base + ("positions", "gate"), None, *_scalar())
    yield TensorMap(positions + "tile_embedding.weight", base + ("positions", "tile_embedding"), None,
                    *_aspect_table(tower, num_positions(tower)))
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
        layer = tensor_map.layer
        if isinstance(layer, slice):  # a one-element slice of a stack (the gates)
            layer, value = layer.start, value[0]
        leaves.setdefault(tensor_map.path, {})[layer] = value
    tree: dict = {}
    for path, by_layer in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = by_layer[None] if None in by_layer else np.stack([by_layer[i] for i in sorted(by_layer)])
    return tree


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    """An MllamaConfig (dict) -> the text model (Llama's self-attention layers `dense` and the
    cross-attention layers `cross` where cross_attention_layers says) with the tower."""
    text_cfg = dict(cfg.get("text_config") or {})
    crosses = set(text_cfg.pop("cross_attention_layers", None) or (3, 8, 13, 18, 23, 28, 33, 38))
    layers = text_cfg.get("num_hidden_layers", 40)
    if not crosses <= set(range(layers)):
        raise ConfigError(f"text_config.cross_attention_layers {sorted(crosses)} name layers outside 0..{layers - 1}")
    text_cfg["model_type"] = "llama"
    text_cfg.setdefault("max_position_embeddings", 131072)
    try:
        text = dense_spec_from_config(text_cfg, "llama", name, param_dtype or config_dtype(cfg))
    except KeyError as err:
        raise ConfigError(f"text_config has no {err.args[0]}") from None
    (dense,) = text.blocks.values()
    self_att, eps = dense.attention, text_cfg.get("rms_norm_eps", 1e-6)
    cross = Block(attention=CrossAttention(heads=self_att.heads, kv_heads=self_att.kv_heads,
                                           head_dim=self_att.head_dim, qk_norm=RMSNorm(eps=eps)),
                  mlp=dense.mlp, norm=dense.norm)
    kinds = ["cross" if i in crosses else "dense" for i in range(layers)]
    return text.model_copy(update={
        "embedding": text.embedding.model_copy(update={"extra_rows": EXTRA_ROWS}),
        "blocks": {"dense": dense, "cross": cross}, "layers": tuple(segments(kinds)),
        "vision": tower_from_config(cfg)})


def text_tensor_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    """The text model's tensors, hub spelling (`language_model.model.*`, `language_model.lm_head`)."""
    for tensor_map in top_level_maps(spec):
        yield _renamed(tensor_map, "language_model." + tensor_map.hf_name)
    for slot in layer_slots(spec):
        block = spec.blocks[slot.block]
        entry = layer_entry(slot)
        for tensor_map in norm_maps(entry, block, slot.block):
            yield _renamed(tensor_map, "language_model." + tensor_map.hf_name)
        att = block.attention
        if isinstance(att, CrossAttention):
            for tensor_map in attention_maps(entry, att, slot.block):
                yield _renamed(tensor_map, "language_model." + tensor_map.hf_name.replace(".self_attn.", ".cross_attn."))
            for hf_name, name in (("cross_attn_attn_gate", "attention_gate"), ("cross_attn_mlp_gate", "mlp_gate")):
                yield _gate(f"language_model.{entry.hf_prefix}{hf_name}", entry.base + ("attention", name), slot.repeat)
        else:
            for tensor_map in attention_maps(entry, att, slot.block):
                yield _renamed(tensor_map, "language_model." + tensor_map.hf_name)
        for proj in ("gate", "up", "down"):
            tensor_map = entry(f"mlp.{proj}_proj.weight", ("mlp", proj, "kernel"), (_transpose, _transpose))
            yield _renamed(tensor_map, "language_model." + tensor_map.hf_name)


def _renamed(tensor_map: TensorMap, name: str) -> TensorMap:
    import dataclasses

    return dataclasses.replace(tensor_map, hf_name=name)


def tensor_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    yield from text_tensor_maps(spec)
    yield from vision_tensor_maps(spec.vision)


def canonical_names(names) -> dict[str, str]:
    """transformers' module-tree names -> the hub's, for the names spelt that way."""
    out = {}
    for name in names:
        if name.startswith("model.language_model."):
            out[name] = "language_model.model." + name[len("model.language_model."):]
        elif name == "lm_head.weight":
            out[name] = "language_model.lm_head.weight"
        elif name.startswith(("model.vision_model.", "model.multi_modal_projector.")):
            out[name] = name[len("model."):]
    return out


def describes(spec: ModelSpec) -> bool:
    return spec.vision is not None and isinstance(spec.vision.entry, CrossAttentionEntry)


def config_from_spec(spec: ModelSpec) -> dict:
    """The spec -> an MllamaConfig dict (for export); what MllamaConfig cannot say is a LayoutError."""
    from mxc.compiler.hf.config_out import config_from_spec as dense_config

    kinds = spec.layer_kinds
    names = sorted(set(kinds), key=kinds.index)
    selfs = [n for n in names if not isinstance(spec.blocks[n].attention, CrossAttention)]
    if len(selfs) != 1:
        raise LayoutError("Llama 3.2 Vision's text model has one self-attention layer kind beside its "
                          f"cross-attention layers; this spec has {len(selfs)}")
    text_spec = spec.model_copy(update={
        "vision": None, "embedding": spec.embedding.model_copy(update={"extra_rows": 0}),
        "blocks": {"block": spec.blocks[selfs[0]]}, "layers": (Segment(period=("block",), repeat=len(kinds)),)})
    text = dense_config(text_spec)
    text.pop("architectures", None)
    text.update(model_type="mllama_text_model",
                cross_attention_layers=[i for i, k in enumerate(kinds) if k not in selfs])
    tower = spec.vision
    att = tower.block.attention
    vision = {"model_type": "mllama_vision_model", "image_size": tower.image, "patch_size": tower.patches.size,
              "num_channels": tower.patches.channels, "hidden_size": tower.d_model, "attention_heads": att.heads,
              "intermediate_size": tower.block.mlp.hidden, "num_hidden_layers": tower.layers,
              "num_global_layers": tower.global_layers, "norm_eps": tower.block.norm.eps, "hidden_act": "gelu",
              "max_num_tiles": tower.tiles.max, "intermediate_layers_indices": list(tower.intermediate),
              "vision_output_dim": tower.d_model * (1 + len(tower.intermediate)),
              "supported_aspect_ratios": _aspect_ratios(tower.tiles)}
    cfg = {"architectures": [ARCHITECTURES["mllama"]], "model_type": "mllama", "dtype": spec.param_dtype,
           "image_token_index": tower.entry.token, "text_config": text, "vision_config": vision}
    back = spec_from_config(cfg, spec.name, spec.param_dtype)
    if back.model_copy(update={"compute_dtype": spec.compute_dtype}) != spec:
        raise LayoutError("this model is not one transformers' MllamaForConditionalGeneration builds (its "
                          "norms, biases, gates, extra embedding rows and tower are fixed there)")
    return cfg


def _aspect_ratios(tiles: Tiles) -> list[list[int]]:
    """MllamaImageProcessor's arrangements of up to `max` tiles (rows x columns), in its order."""
    ratios = [[w, h] for w in range(1, tiles.max + 1) for h in range(1, tiles.max + 1) if w * h <= tiles.max]
    if len(ratios) != tiles.aspect_ratios:
        raise LayoutError(f"{tiles.aspect_ratios} aspect ratios are not the {len(ratios)} arrangements of up to "
                          f"{tiles.max} tiles that transformers lists")
    return ratios


CONVERTER = FamilyConverter(model_types=("mllama",), architectures=ARCHITECTURES, spec_from_config=spec_from_config,
                            config_from_spec=config_from_spec, describes=describes, tensor_maps=tensor_maps,
                            canonical_names=canonical_names)
