"""Gemma 3 with images (model_type gemma3, Gemma3ForConditionalGeneration): the Gemma 3 text model
(read as gemma3_text), a SigLIP vision tower and Gemma 3's pooling projector.

Checkpoints spell the same tensors three ways: transformers' module tree (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`), what its save_pretrained writes
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) and the hub's original
files (`vision_tower.vision_model.*`). The maps here use the first; `canonical_names` reads the
others, and export writes a checkpoint back under the names it was read with.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from mxc.compiler.hf.config_in import ACTIVATIONS, ConfigError, config_dtype
from mxc.compiler.hf.families import FamilyConverter
from mxc.compiler.hf.mapping import LayoutError, TensorMap, _heads_bias, _heads_in, _heads_out, _same, _transpose
from mxc.spec.ir import (MHA, MLP, EncoderBlock, ImagePlaceholders, LayerNorm, LearnedPositions, ModelSpec,
                         Patches, PooledProjector, RMSNorm, VisionTower)

ARCHITECTURES = {"gemma3": "Gemma3ForConditionalGeneration"}
TEXT, VISION, PROJECTOR = "model.language_model.", "model.vision_tower.", "model.multi_modal_projector."
# Other spellings of each canonical prefix, longest first so that a longer one wins.
SPELLINGS = {TEXT: ("language_model.model.",),
             VISION: ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "vision_tower."),
             PROJECTOR: ("multi_modal_projector.",),
             "lm_head.": ("language_model.lm_head.",)}


def canonical_names(names: Iterable[str]) -> dict[str, str]:
    """checkpoint name -> the name the maps use, for every name spelt another way."""
    renamed = {}
    for name in names:
        for canonical, others in SPELLINGS.items():
            if name.startswith(canonical) and not any(name.startswith(o) for o in others if len(o) > len(canonical)):
                break
            other = next((o for o in others if name.startswith(o)), None)
            if other is not None:
                renamed[name] = canonical + name[len(other):]
                break
    return renamed


def _tower(cfg: dict, text: ModelSpec) -> VisionTower:
    vision = cfg.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model" or vision.get("vision_use_head"):
        raise ConfigError("Gemma 3's vision tower is imported as SigLIP without its pooling head")
    width, heads = vision["hidden_size"], vision["num_attention_heads"]
    eps = vision.get("layer_norm_eps", 1e-6)
    act = ACTIVATIONS.get(vision.get("hidden_act", "gelu_pytorch_tanh"))
    if act is None:
        raise ConfigError(f"vision hidden_act '{vision.get('hidden_act')}' is not imported")
    patch = vision["patch_size"]
    return VisionTower(
        image=vision["image_size"], d_model=width,
        patches=Patches(size=patch, stride=patch, channels=vision.get("num_channels", 3)),
        positions=LearnedPositions(),
        block=EncoderBlock(attention=MHA(heads=heads, head_dim=width // heads, rope=None, qkv_bias=True,
                                         out_bias=True),
                           mlp=MLP(hidden=vision["intermediate_size"], act=act, bias=True),
                           norm=LayerNorm(eps=eps)),
        layers=vision["num_hidden_layers"], final_norm=LayerNorm(eps=eps),
        projector=PooledProjector(tokens=cfg.get("mm_tokens_per_image", 256),
                                  norm=RMSNorm(eps=eps, zero_centered=True)),
        entry=ImagePlaceholders(token=cfg.get("image_token_index", 262144), begin=cfg.get("boi_token_index", 255999),
                                end=cfg.get("eoi_token_index", 256000), bidirectional=True))


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    from mxc.compiler.hf.config_in import spec_from_config as text_spec_from_config

    if not isinstance(cfg.get("text_config"), dict) or not isinstance(cfg.get("vision_config"), dict):
        raise ConfigError("a gemma3 config.json holds text_config and vision_config; a text-only Gemma 3 "
                          "checkpoint is model_type gemma3_text")
    text_cfg = {**(cfg.get("text_config") or {}), "model_type": "gemma3_text"}
    text_cfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    dtype = param_dtype or config_dtype(cfg)
    text = text_spec_from_config(text_cfg, name, dtype)
    return text.model_copy(update={"vision": _tower(cfg, text)})


def describes(spec: ModelSpec) -> bool:
    return spec.vision is not None and isinstance(spec.vision.projector, PooledProjector)


def config_from_spec(spec: ModelSpec) -> dict:
    from mxc.compiler.hf.config_out import HF_ACTIVATIONS, config_from_spec as text_config_from_spec

    tower = spec.vision
    text = text_config_from_spec(spec.model_copy(update={"vision": None}))
    if text.get("model_type") != "gemma3_text":
        raise LayoutError("a vision tower is exported for Gemma 3 text models only")
    text.pop("architectures", None)
    att = tower.block.attention
    return {
        "architectures": [ARCHITECTURES["gemma3"]], "model_type": "gemma3", "dtype": spec.param_dtype,
        "tie_word_embeddings": spec.embedding.tied, "mm_tokens_per_image": tower.projector.tokens,
        "image_token_index": tower.entry.token, "boi_token_index": tower.entry.begin,
        "eoi_token_index": tower.entry.end, "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": tower.d_model,
                          "intermediate_size": tower.block.mlp.hidden, "num_hidden_layers": tower.layers,
                          "num_attention_heads": att.heads, "image_size": tower.image,
                          "patch_size": tower.patches.size, "num_channels": tower.patches.channels,
                          "layer_norm_eps": tower.block.norm.eps, "vision_use_head": False,
                          "hidden_act": HF_ACTIVATIONS[tower.block.mlp.act]},
    }


def _patch_kernel() -> tuple:
    # HF's convolution weight [width, channels, size, size] <-> mxc's kernel [size, size, channels, width].
    return (lambda w: np.transpose(w, (2, 3, 1, 0)), lambda k: np.transpose(k, (3, 2, 0, 1)))


def _vision_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    tower = spec.vision
    att = tower.block.attention
    base = ("vision",)
    yield TensorMap(VISION + "embeddings.patch_embedding.weight", base + ("patches", "kernel"), None, *_patch_kernel())
    yield TensorMap(VISION + "embeddings.patch_embedding.bias", base + ("patches", "bias"), None, _same, _same)
    yield TensorMap(VISION + "embeddings.position_embedding.weight", base + ("positions", "embedding"), None,
                    _same, _same)
    for n in range(tower.layers):
        hf = f"{VISION}encoder.layers.{n}."

        def entry(name, path, convert=(_same, _same)):
            return TensorMap(hf + name, base + ("layers",) + path, n, *convert)

        for norm, mine in (("layer_norm1", "attention_norm"), ("layer_norm2", "mlp_norm")):
            yield entry(f"{norm}.weight", (mine, "scale"))
            yield entry(f"{norm}.bias", (mine, "bias"))
        for proj in ("q", "k", "v"):
            yield entry(f"self_attn.{proj}_proj.weight", ("attention", proj, "kernel"), _heads_in(att.heads, att.head_dim))
            yield entry(f"self_attn.{proj}_proj.bias", ("attention", proj, "bias"), _heads_bias(att.heads, att.head_dim))
        yield entry("self_attn.out_proj.weight", ("attention", "o", "kernel"), _heads_out(att.heads, att.head_dim))
        yield entry("self_attn.out_proj.bias", ("attention", "o", "bias"))
        for fc, mine in (("fc1", "up"), ("fc2", "down")):
            yield entry(f"mlp.{fc}.weight", ("mlp", mine, "kernel"), (_transpose, _transpose))
            yield entry(f"mlp.{fc}.bias", ("mlp", mine, "bias"))
    yield TensorMap(VISION + "post_layernorm.weight", base + ("final_norm", "scale"), None, _same, _same)
    yield TensorMap(VISION + "post_layernorm.bias", base + ("final_norm", "bias"), None, _same, _same)
    # HF keeps the projection as [vision width, d_model], the kernel's own layout.
    yield TensorMap(PROJECTOR + "mm_input_projection_weight", base + ("projector", "kernel"), None, _same, _same)
    yield TensorMap(PROJECTOR + "mm_soft_emb_norm.weight", base + ("projector", "norm", "scale"), None, _same, _same)


def tensor_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    from dataclasses import replace

    from mxc.compiler.hf.mapping import tensor_maps as text_maps

    for entry in text_maps(spec.model_copy(update={"vision": None})):
        name = entry.hf_name
        yield replace(entry, hf_name=TEXT + name[len("model."):] if name.startswith("model.") else name)
    yield from _vision_maps(spec)


CONVERTER = FamilyConverter(model_types=("gemma3",), architectures=ARCHITECTURES, spec_from_config=spec_from_config,
                            config_from_spec=config_from_spec, describes=describes, tensor_maps=tensor_maps,
                            canonical_names=canonical_names)
