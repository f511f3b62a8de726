"""Llama 4 text models (model_type llama4_text, Llama4ForCausalLM).

Layers with RoPE (no_rope_layers[i] = 1) rotate adjacent pairs (the complex form), use chunked
attention (layer_types chunked_attention, attention_chunk_size) and, with use_qk_norm, a
scale-free L2 norm of queries and keys; the others are NoPE layers with full attention and, with
attn_temperature_tuning, a query temperature growing with position. The layers in moe_layers are
mixtures of GLU experts with one shared expert: a sigmoid of the top-k router logits scales each
expert's input. The other layers are dense GLUs of intermediate_size_mlp.

The checkpoint fuses each layer's expert gate and up kernels into gate_up_proj
[experts, embed, 2 · hidden] (gate first, then up) and stores down_proj as [experts, hidden,
embed]: kernels [in, out], as mxc keeps them. HF's Llama 4 normalises queries and keys after
RoPE, mxc before: a rotation keeps the root mean square, so the two agree.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from mxc.compiler.hf.config_in import ConfigError, _activation, config_dtype, rope_from_config, segments
from mxc.compiler.hf.config_out import HF_ACTIVATIONS, check_round_trip, rope_parameters
from mxc.compiler.hf.families import FamilyConverter, attention_class, block_names
from mxc.compiler.hf.decoder_maps import decoder_maps
from mxc.compiler.hf.mapping import FusedTensorMap, LayoutError, _same, _transpose
from mxc.spec.ir import GLU, MLA, Block, Embedding, ModelSpec, MoE, RMSNorm, Router, TemperatureTuning

ARCHITECTURES = {"llama4_text": "Llama4ForCausalLM"}
FULL, CHUNKED = "full_attention", "chunked_attention"


def _layer_lists(cfg: dict) -> tuple[list[int], list[str], set[int]]:
    """(uses rope, per layer), (layer type, per layer) and the MoE layers, as Llama4TextConfig derives them."""
    n = cfg["num_hidden_layers"]
    interval = cfg.get("no_rope_layer_interval", 4)
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    types = cfg.get("layer_types") or [CHUNKED if rope else FULL for rope in uses_rope]
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
    if len(uses_rope) != n or len(types) != n or set(types) - {FULL, CHUNKED}:
        raise ConfigError(f"no_rope_layers and layer_types must describe each of the {n} layers "
                          "(layer types full_attention or chunked_attention)")
    return list(uses_rope), list(types), moe_layers


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps = cfg.get("rms_norm_eps", 1e-5)
    bias = bool(cfg.get("attention_bias", False))
    rope = rope_from_config(cfg, "llama4_text", FULL).model_copy(update={"interleaved": True})
    act = _activation(cfg, "llama4_text", _llama_family())
    tuning = None
    if cfg.get("attn_temperature_tuning", True):
        tuning = TemperatureTuning(floor_scale=cfg.get("floor_scale", 8192), attn_scale=cfg.get("attn_scale", 0.1))
    moe = MoE(experts=cfg["num_local_experts"], top_k=cfg.get("num_experts_per_tok", 1),
              expert=GLU(hidden=cfg["intermediate_size"], act=act), shared_experts=1,
              router=Router(score="sigmoid", normalize=False, weight_on="input"))
    dense = GLU(hidden=cfg.get("intermediate_size_mlp", cfg["intermediate_size"]), act=act)
    make_attention = attention_class(heads, kv_heads)
    uses_rope, types, moe_layers = _layer_lists(cfg)
    layers, labels = [], []
    for i, (rope_layer, layer_type) in enumerate(zip(uses_rope, types)):
        fields = dict(heads=heads, head_dim=head_dim, qkv_bias=bias, out_bias=bias)
        if layer_type == CHUNKED and cfg.get("attention_chunk_size"):
            fields["chunk"] = cfg["attention_chunk_size"]
        if rope_layer:
            fields["rope"] = rope
            if cfg.get("use_qk_norm", True):
                fields["qk_norm"] = RMSNorm(eps=eps, scale=False)
        else:
            fields.update(rope=None, temperature_tuning=tuning)
        is_moe = i in moe_layers
        layers.append(Block(attention=make_attention(**fields), mlp=moe if is_moe else dense, norm=RMSNorm(eps=eps)))
        labels.append(("rope" if rope_layer else "nope") + ("_moe" if is_moe else "_dense"))
    names = block_names(layers, labels)
    return ModelSpec(
        name=name, vocab=cfg["vocab_size"], d_model=cfg["hidden_size"], max_seq=cfg["max_position_embeddings"],
        embedding=Embedding(tied=cfg.get("tie_word_embeddings", False)), final_norm=RMSNorm(eps=eps),
        param_dtype=param_dtype or config_dtype(cfg), compute_dtype="bfloat16",
        blocks=dict(zip(names, layers)), layers=tuple(segments(names)))


def _llama_family():
    from mxc.compiler.hf.config_in import FAMILIES

    return FAMILIES["llama"]


def describes(spec: ModelSpec) -> bool:
    blocks = list(spec.blocks.values())
    if spec.vision is not None or any(isinstance(b.attention, MLA) for b in blocks):
        return False  # with a vision tower: compiler/hf/llama4_vision.py
    return any(b.attention.chunk is not None or b.attention.temperature_tuning is not None
               or b.attention.rope is not None and b.attention.rope.interleaved
               or isinstance(b.mlp, MoE) and b.mlp.router.weight_on == "input" for b in blocks)


def _one(values: set, what: str):
    if len(values) > 1:
        raise LayoutError(f"Llama 4 configs hold one {what} for every layer; this spec has several")
    return values.pop() if values else None


def config_from_spec(spec: ModelSpec) -> dict:
    layers = [spec.blocks[name] for name in spec.layer_kinds]
    moe = _one({b.mlp for b in layers if isinstance(b.mlp, MoE)}, "expert layout")
    dense = _one({b.mlp for b in layers if not isinstance(b.mlp, MoE)}, "dense feed-forward")
    att = layers[0].attention
    rope = _one({b.attention.rope for b in layers} - {None}, "rope")
    tuning = _one({b.attention.temperature_tuning for b in layers} - {None}, "temperature tuning")
    expert = moe.expert if moe is not None else dense
    cfg = {
        "architectures": [ARCHITECTURES["llama4_text"]], "model_type": "llama4_text",
        "vocab_size": spec.vocab, "hidden_size": spec.d_model, "num_hidden_layers": len(layers),
        "num_attention_heads": att.heads, "num_key_value_heads": att.kv_heads, "head_dim": att.head_dim,
        "max_position_embeddings": spec.max_seq, "rms_norm_eps": spec.final_norm.eps,
        "tie_word_embeddings": spec.embedding.tied, "dtype": spec.param_dtype, "attention_bias": att.qkv_bias,
        "hidden_act": HF_ACTIVATIONS[expert.act], "intermediate_size": expert.hidden,
        "intermediate_size_mlp": (dense or expert).hidden,
        "num_local_experts": moe.experts if moe else 1, "num_experts_per_tok": moe.top_k if moe else 1,
        "moe_layers": [i for i, b in enumerate(layers) if isinstance(b.mlp, MoE)],
        "no_rope_layers": [int(b.attention.rope is not None) for b in layers],
        "layer_types": [CHUNKED if b.attention.chunk is not None else FULL for b in layers],
        "attention_chunk_size": _one({b.attention.chunk for b in layers} - {None}, "attention chunk"),
        "use_qk_norm": any(b.attention.qk_norm is not None for b in layers),
        "attn_temperature_tuning": tuning is not None,
        "rope_parameters": rope_parameters(rope) if rope else
        {"rope_theta": 500000.0, "rope_type": "default"},
    }
    if tuning is not None:
        cfg.update(floor_scale=_number(tuning.floor_scale), attn_scale=tuning.attn_scale)
    check_round_trip(spec, cfg)
    return cfg


def _number(value: float):
    return int(value) if float(value).is_integer() else value


def _split_halves(fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 2·hidden], the gate's half first -> (gate [..., hidden], up [..., hidden])."""
    hidden = fused.shape[-1] // 2
    return fused[..., :hidden], fused[..., hidden:]


def _concatenate(parts: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, axis=-1)


def _feed_forward_maps(entry, ffn, where: str) -> Iterator:
    if isinstance(ffn, MoE):
        if ffn.shared_experts != 1 or not isinstance(ffn.expert, GLU) or ffn.expert.bias:
            raise LayoutError(f"block '{where}': Llama 4 experts are bias-free GLUs with one shared expert")
        yield entry("feed_forward.router.weight", ("mlp", "router", "kernel"), (_transpose, _transpose))
        experts = entry.base + ("mlp", "experts")
        yield FusedTensorMap(entry.hf_prefix + "feed_forward.experts.gate_up_proj",
                             (experts + ("gate", "kernel"), experts + ("up", "kernel")), entry.repeat,
                             _split_halves, _concatenate)
        yield entry("feed_forward.experts.down_proj", ("mlp", "experts", "down", "kernel"), (_same, _same))
        for proj in ("gate", "up", "down"):
            yield entry(f"feed_forward.shared_expert.{proj}_proj.weight", ("mlp", "shared", proj, "kernel"),
                        (_transpose, _transpose))
    else:
        for proj in ("gate", "up", "down"):
            yield entry(f"feed_forward.{proj}_proj.weight", ("mlp", proj, "kernel"), (_transpose, _transpose))


def tensor_maps(spec: ModelSpec) -> Iterator:
    return decoder_maps(spec, _feed_forward_maps)


CONVERTER = FamilyConverter(model_types=("llama4_text",), architectures=ARCHITECTURES,
                            spec_from_config=spec_from_config, config_from_spec=config_from_spec,
                            describes=describes, tensor_maps=tensor_maps)
