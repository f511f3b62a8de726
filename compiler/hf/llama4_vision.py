"""Llama 4 with images (model_type llama4, Llama4ForConditionalGeneration): the Llama 4 text model
(text_config, read as llama4_text by compiler/hf/llama4.py), the vision tower and the multi-modal
projector. The config's vision_config and image token ids <-> spec.ir.VisionTower, and HF tensor
names <-> the tower's parameters (layout in mxc.compiler.lower.vision_llama4).

Checkpoints (transformers' save_pretrained and the hub's) name the text model's tensors as
Llama4ForCausalLM does under `language_model.`, the tower `vision_model.*` (encoder layers
`vision_model.model.layers.N.*`, the adapter `vision_model.vision_adapter.mlp.fc1/fc2`) and the
projector `multi_modal_projector.linear_1`. Every conversion is a transpose or reshape, so import
and export are exact inverses.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from mxc.compiler.hf import llama4
from mxc.compiler.hf.config_in import ConfigError, config_dtype, square_size
from mxc.compiler.hf.families import FamilyConverter
from mxc.compiler.hf.mapping import LayoutError, TensorMap, _heads_bias, _heads_in, _heads_out, _same, _transpose
from mxc.spec.ir import (MHA, MLP, AxialRope, EncoderBlock, ImagePlaceholders, LayerNorm, LearnedPositions,
                         ModelSpec, Patches, PixelShuffleProjector, VisionTower)

ARCHITECTURES = {"llama4": "Llama4ForConditionalGeneration"}
TEXT = "language_model."

# Llama4Config's defaults for the image tokens (image_token_index, boi_token_index, eoi_token_index).
IMAGE_TOKENS = {"image_token_index": 200092, "boi_token_index": 200080, "eoi_token_index": 200081}


def tower_from_config(cfg: dict) -> VisionTower:
    """A Llama4Config (dict) -> its vision tower; what mxc cannot express is a ConfigError."""
    vision_cfg = cfg.get("vision_config") or {}

    def size(key, default=None):
        return square_size(vision_cfg, key, default, "mxc's Llama 4 tower takes square images and patches")

    act = vision_cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(f"vision_config.hidden_act '{act}': Llama 4's vision layers use gelu (transformers "
                          "ignores the setting)")
    width, heads, ratio = size("hidden_size", 768), size("num_attention_heads", 16), size("pixel_shuffle_ratio", 0.5)
    adapter = size("projector_input_dim", 4096)
    # transformers sizes the adapter's input by intermediate_size, its second matrix by
    # projector_output_dim on both sides and the projector's input by vision_output_dim: the shapes
    # only fit when the first equals the shuffled width and the other three are one width.
    hidden = size("intermediate_size", 5632)
    if hidden * ratio ** 2 != width:
        raise ConfigError(f"vision_config.intermediate_size {hidden} must equal hidden_size / "
                          f"pixel_shuffle_ratio² = {width / ratio ** 2:g} (the adapter's input in transformers)")
    for key in ("projector_output_dim", "vision_output_dim"):
        if size(key, adapter) != adapter:
            raise ConfigError(f"vision_config.{key} {vision_cfg[key]} must equal projector_input_dim "
                              f"{adapter} (the adapter's width, which the projector reads)")
    if vision_cfg.get("multi_modal_projector_bias"):
        raise ConfigError("vision_config.multi_modal_projector_bias: transformers' projector has no bias")
    rope = vision_cfg.get("rope_parameters") or {}
    eps = vision_cfg.get("norm_eps", 1e-5)
    norm = LayerNorm(eps=eps)
    patch = size("patch_size", 14)
    tokens = {key: cfg.get(key, default) for key, default in IMAGE_TOKENS.items()}
    return VisionTower(
        image=size("image_size", 448), d_model=width,
        patches=Patches(size=patch, stride=patch, channels=vision_cfg.get("num_channels", 3), bias=False),
        positions=LearnedPositions(),
        block=EncoderBlock(attention=MHA(heads=heads, head_dim=width // heads, rope=None, qkv_bias=True,
                                         out_bias=True),
                           mlp=MLP(hidden=hidden, act="gelu", bias=True), norm=norm),
        layers=size("num_hidden_layers", 34), final_norm=norm,
        projector=PixelShuffleProjector(ratio=ratio, adapter=adapter),
        entry=ImagePlaceholders(token=tokens["image_token_index"], begin=tokens["boi_token_index"],
                                end=tokens["eoi_token_index"]),
        class_token=True, pre_norm=norm,
        rope=AxialRope(theta=float(rope.get("rope_theta", vision_cfg.get("rope_theta", 10000.0)))))


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    text_cfg = dict(cfg.get("text_config") or {})
    text_cfg.setdefault("model_type", "llama4_text")
    if text_cfg["model_type"] != "llama4_text":
        raise ConfigError(f"text_config.model_type '{text_cfg['model_type']}': Llama 4's text model is llama4_text")
    try:
        text = llama4.spec_from_config(text_cfg, name, param_dtype or config_dtype(cfg))
    except KeyError as err:
        raise ConfigError(f"text_config has no {err.args[0]}") from None
    return text.model_copy(update={"vision": tower_from_config(cfg)})


def describes(spec: ModelSpec) -> bool:
    return spec.vision is not None and isinstance(spec.vision.projector, PixelShuffleProjector)


def _text(spec: ModelSpec) -> ModelSpec:
    return spec.model_copy(update={"vision": None})


def config_from_spec(spec: ModelSpec) -> dict:
    text_cfg = llama4.config_from_spec(_text(spec))
    text_cfg.pop("architectures")
    return {"architectures": [ARCHITECTURES["llama4"]], "model_type": "llama4", "dtype": spec.param_dtype,
            "tie_word_embeddings": spec.embedding.tied, "text_config": text_cfg, **config_from_tower(spec.vision)}


def config_from_tower(tower: VisionTower) -> dict:
    """The tower -> Llama4Config's vision_config and image token fields (for export)."""
    att, mlp = tower.block.attention, tower.block.mlp
    expected = tower_from_config({"vision_config": {
        "image_size": tower.image, "patch_size": tower.patches.size, "num_channels": tower.patches.channels,
        "hidden_size": tower.d_model, "num_attention_heads": getattr(att, "heads", 0),
        "intermediate_size": getattr(mlp, "hidden", 0), "num_hidden_layers": tower.layers,
        "norm_eps": tower.block.norm.eps, "pixel_shuffle_ratio": tower.projector.ratio,
        "projector_input_dim": tower.projector.adapter, "rope_parameters": {"rope_theta": tower.rope.theta}
        if tower.rope else {}}, "image_token_index": tower.entry.token, "boi_token_index": tower.entry.begin,
        "eoi_token_index": tower.entry.end})
    if expected != tower:
        raise LayoutError("the vision tower is not Llama 4's (transformers' Llama4VisionModel fixes the norms, "
                          "biases, activations, class token and 2D RoPE that this tower changes)")
    v = tower.projector
    vision_cfg = {"model_type": "llama4_vision_model", "image_size": tower.image, "patch_size": tower.patches.size,
                  "num_channels": tower.patches.channels, "hidden_size": tower.d_model,
                  "num_attention_heads": att.heads, "intermediate_size": mlp.hidden,
                  "num_hidden_layers": tower.layers, "norm_eps": tower.block.norm.eps, "hidden_act": "gelu",
                  "rope_parameters": {"rope_theta": tower.rope.theta, "rope_type": "default"},
                  "pixel_shuffle_ratio": v.ratio, "projector_input_dim": v.adapter, "projector_output_dim": v.adapter,
                  "vision_output_dim": v.adapter, "multi_modal_projector_bias": False}
    return {"vision_config": vision_cfg, "image_token_index": tower.entry.token,
            "boi_token_index": tower.entry.begin, "eoi_token_index": tower.entry.end}


def _patches(tower: VisionTower):
    # HF [width, channel · row · column] (torch's Unfold order) <-> mxc [row, column, channel, width]
    p, c = tower.patches.size, tower.patches.channels
    return (lambda w: w.reshape(w.shape[0], c, p, p).transpose(2, 3, 1, 0),
            lambda k: k.transpose(3, 2, 0, 1).reshape(k.shape[-1], c * p * p))


def _layernorm(hf: str, path: tuple, layer=None) -> Iterator[TensorMap]:
    yield TensorMap(hf + ".weight", path + ("scale",), layer, _same, _same)
    yield TensorMap(hf + ".bias", path + ("bias",), layer, _same, _same)


def tensor_maps(spec: ModelSpec) -> Iterator:
    """Every HF tensor: the text model's as Llama4ForCausalLM names them under `language_model.`,
    then the tower's and projector's."""
    for entry in llama4.tensor_maps(_text(spec)):
        yield dataclasses.replace(entry, hf_name=TEXT + entry.hf_name)
    yield from vision_tensor_maps(spec)


def vision_tensor_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    """The tower's and projector's tensors (under params["vision"])."""
    tower, base, hf = spec.vision, ("vision",), "vision_model."
    heads, head_dim = tower.block.attention.heads, tower.block.attention.head_dim
    yield TensorMap(hf + "patch_embedding.linear.weight", base + ("patches", "kernel"), None, *_patches(tower))
    yield TensorMap(hf + "class_embedding", base + ("class_embedding",), None, _same, _same)
    yield TensorMap(hf + "positional_embedding_vlm", base + ("positions", "embedding"), None, _same, _same)
    yield from _layernorm(hf + "layernorm_pre", base + ("pre_norm",))
    yield from _layernorm(hf + "layernorm_post", base + ("final_norm",))
    layers = base + ("layers",)
    for i in range(tower.layers):
        layer = f"{hf}model.layers.{i}."
        yield from _layernorm(layer + "input_layernorm", layers + ("attention_norm",), i)
        yield from _layernorm(layer + "post_attention_layernorm", layers + ("mlp_norm",), i)
        for proj in ("q", "k", "v"):
            yield TensorMap(layer + f"self_attn.{proj}_proj.weight", layers + ("attention", proj, "kernel"), i,
                            *_heads_in(heads, head_dim))
            yield TensorMap(layer + f"self_attn.{proj}_proj.bias", layers + ("attention", proj, "bias"), i,
                            *_heads_bias(heads, head_dim))
        yield TensorMap(layer + "self_attn.o_proj.weight", layers + ("attention", "o", "kernel"), i,
                        *_heads_out(heads, head_dim))
        yield TensorMap(layer + "self_attn.o_proj.bias", layers + ("attention", "o", "bias"), i, _same, _same)
        for fc, proj in (("fc1", "up"), ("fc2", "down")):
            yield TensorMap(layer + f"mlp.{fc}.weight", layers + ("mlp", proj, "kernel"), i, _transpose, _transpose)
            yield TensorMap(layer + f"mlp.{fc}.bias", layers + ("mlp", proj, "bias"), i, _same, _same)
    for fc, proj in (("fc1", "up"), ("fc2", "down")):
        yield TensorMap(f"{hf}vision_adapter.mlp.{fc}.weight", base + ("projector", "adapter", proj, "kernel"), None,
                        _transpose, _transpose)
    yield TensorMap("multi_modal_projector.linear_1.weight", base + ("projector", "kernel"), None,
                    _transpose, _transpose)


CONVERTER = FamilyConverter(model_types=("llama4",), architectures=ARCHITECTURES, spec_from_config=spec_from_config,
                            config_from_spec=config_from_spec, describes=describes, tensor_maps=tensor_maps)
