"""Llama 4's vision tower and multi-modal projector (Llama4ForConditionalGeneration): the HF
vision config <-> Llama4Vision sizes, and HF tensor names <-> the tower's parameter tree
(layout in mxc.compiler.lower.vision_llama4).

HF names the tower `vision_model.*` and the projector `multi_modal_projector.linear_1`; the
encoder's layers are `vision_model.model.layers.N.*`, the adapter `vision_model.vision_adapter.mlp.fc1/fc2`.
Every conversion is a transpose or reshape, so import and export are exact inverses.
"""

from __future__ import annotations

from typing import Iterator

from mxc.compiler.hf.config_in import ConfigError
from mxc.compiler.hf.mapping import TensorMap, _heads_bias, _heads_in, _heads_out, _same, _transpose
from mxc.compiler.lower.vision_llama4 import Llama4Vision


def vision_from_config(vision_cfg: dict, text_d_model: int) -> Llama4Vision:
    """Llama4VisionConfig (a dict) -> the tower's sizes; what mxc cannot express is a ConfigError."""
    def size(key):
        value = vision_cfg[key]
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ConfigError(f"vision_config.{key} {value}: mxc's Llama 4 tower takes square images and patches")
            value = value[0]
        return value

    act = vision_cfg.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(f"vision_config.hidden_act '{act}': Llama 4's vision layers use gelu (transformers "
                          "ignores the setting)")
    rope = vision_cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", vision_cfg.get("rope_theta", 10000.0))
    vision = Llama4Vision(
        image=size("image_size"), patch=size("patch_size"), channels=vision_cfg.get("num_channels", 3),
        width=vision_cfg["hidden_size"], heads=vision_cfg["num_attention_heads"],
        hidden=vision_cfg["intermediate_size"], layers=vision_cfg["num_hidden_layers"],
        norm_eps=vision_cfg.get("norm_eps", 1e-5), rope_theta=float(theta),
        shuffle_ratio=vision_cfg.get("pixel_shuffle_ratio", 0.5),
        adapter=vision_cfg["projector_input_dim"], text_d_model=text_d_model)
    # transformers sizes the adapter's input by intermediate_size, its second matrix by
    # projector_output_dim on both sides and the projector's input by vision_output_dim: the shapes
    # only fit when the first equals the shuffled width and the other three are one width.
    if vision.hidden != vision.shuffled_width:
        raise ConfigError(f"vision_config.intermediate_size {vision.hidden} must equal hidden_size / "
                          f"pixel_shuffle_ratio² = {vision.shuffled_width} (the adapter's input in transformers)")
    for key in ("projector_output_dim", "vision_output_dim"):
        if vision_cfg.get(key, vision.adapter) != vision.adapter:
            raise ConfigError(f"vision_config.{key} {vision_cfg[key]} must equal projector_input_dim "
                              f"{vision.adapter} (the adapter's width, which the projector reads)")
    return vision


def config_from_vision(v: Llama4Vision) -> dict:
    """The tower's sizes -> Llama4VisionConfig fields (for export)."""
    return {"model_type": "llama4_vision_model", "image_size": v.image, "patch_size": v.patch,
            "num_channels": v.channels, "hidden_size": v.width, "num_attention_heads": v.heads,
            "intermediate_size": v.hidden, "num_hidden_layers": v.layers, "norm_eps": v.norm_eps,
            "rope_parameters": {"rope_theta": v.rope_theta, "rope_type": "default"}, "hidden_act": "gelu",
            "pixel_shuffle_ratio": v.shuffle_ratio, "projector_input_dim": v.adapter,
            "projector_output_dim": v.adapter, "vision_output_dim": v.adapter,
            "multi_modal_projector_bias": False}


def _patches(v: Llama4Vision):
    # HF [width, channel · row · column] (torch's Unfold order) <-> mxc [row, column, channel, width]
    p, c = v.patch, v.channels
    return (lambda w: w.reshape(w.shape[0], c, p, p).transpose(2, 3, 1, 0),
            lambda k: k.transpose(3, 2, 0, 1).reshape(k.shape[-1], c * p * p))


def _layernorm(hf: str, path: tuple, layer=None) -> Iterator[TensorMap]:
    yield TensorMap(hf + ".weight", path + ("scale",), layer, _same, _same)
    yield TensorMap(hf + ".bias", path + ("bias",), layer, _same, _same)


def tensor_maps(v: Llama4Vision, base: tuple = ()) -> Iterator[TensorMap]:
    """Every HF tensor of the tower and projector; `base` is the tower's path in the parameter tree."""
    tower = "vision_model."
    yield TensorMap(tower + "patch_embedding.linear.weight", base + ("patches", "kernel"), None, *_patches(v))
    yield TensorMap(tower + "class_embedding", base + ("class_embedding",), None, _same, _same)
    yield TensorMap(tower + "positional_embedding_vlm", base + ("positions", "embedding"), None, _same, _same)
    yield from _layernorm(tower + "layernorm_pre", base + ("pre_norm",))
    yield from _layernorm(tower + "layernorm_post", base + ("final_norm",))
    layers = base + ("layers",)
    for i in range(v.layers):
        hf = f"{tower}model.layers.{i}."
        yield from _layernorm(hf + "input_layernorm", layers + ("attention_norm",), i)
        yield from _layernorm(hf + "post_attention_layernorm", layers + ("mlp_norm",), i)
        for proj in ("q", "k", "v"):
            yield TensorMap(hf + f"self_attn.{proj}_proj.weight", layers + ("attention", proj, "kernel"), i,
                            *_heads_in(v.heads, v.head_dim))
            yield TensorMap(hf + f"self_attn.{proj}_proj.bias", layers + ("attention", proj, "bias"), i,
                            *_heads_bias(v.heads, v.head_dim))
        yield TensorMap(hf + "self_attn.o_proj.weight", layers + ("attention", "o", "kernel"), i,
                        *_heads_out(v.heads, v.head_dim))
        yield TensorMap(hf + "self_attn.o_proj.bias", layers + ("attention", "o", "bias"), i, _same, _same)
        for fc, proj in (("fc1", "up"), ("fc2", "down")):
            yield TensorMap(hf + f"mlp.{fc}.weight", layers + ("mlp", proj, "kernel"), i, _transpose, _transpose)
            yield TensorMap(hf + f"mlp.{fc}.bias", layers + ("mlp", proj, "bias"), i, _same, _same)
    for fc, proj in (("fc1", "up"), ("fc2", "down")):
        yield TensorMap(f"{tower}vision_adapter.mlp.{fc}.weight", base + ("projector", "adapter", proj, "kernel"), None,
                        _transpose, _transpose)
    yield TensorMap("multi_modal_projector.linear_1.weight", base + ("projector", "kernel"), None,
                    _transpose, _transpose)
