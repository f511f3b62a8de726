"""Mixtral and Qwen3-MoE: the Llama layout with mixtures of GLU experts, one tensor per expert
and projection, routed by a softmax over a bias-free linear router.

Mixtral renormalises its top-k weights and routes on every layer; Qwen3-MoE renormalises when
norm_topk_prob is set and keeps dense layers where mlp_only_layers and decoder_sparse_step say.
Attention is Mistral's (Mixtral) or Qwen3's (QK-norm, optional biases), read by config_in.
"""

from __future__ import annotations

from typing import Iterator

from mxc.compiler.hf.config_in import (FULL, SLIDING, ConfigError, block_from_config, config_dtype, segments,
                                       _activation)
from mxc.compiler.hf.config_out import HF_ACTIVATIONS, check_round_trip, rope_parameters
from mxc.compiler.hf.families import FamilyConverter, block_names
from mxc.compiler.hf.decoder_maps import decoder_maps
from mxc.compiler.hf.mapping import LayoutError, _transpose
from mxc.spec.ir import GLU, MLA, Embedding, ModelSpec, MoE, RMSNorm, Router

# model_type -> the config_in family whose attention it shares, the MoE module's name in the
# checkpoint, and the expert tensors' names for gate, up and down.
LAYOUT = {
    "mixtral": ("mistral", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("qwen3", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _window(cfg: dict, kind: str) -> int | None:
    if kind == "qwen3_moe" and not cfg.get("use_sliding_window"):
        return None
    return cfg.get("sliding_window")


def _is_moe_layer(cfg: dict, kind: str, index: int) -> bool:
    if kind == "mixtral":
        return True
    step = cfg.get("decoder_sparse_step", 1)
    return index not in (cfg.get("mlp_only_layers") or []) and _experts(cfg) > 0 and (index + 1) % step == 0


def _experts(cfg: dict) -> int:
    # The hub spells Qwen3-MoE's count num_experts; transformers 5 writes num_local_experts.
    return cfg.get("num_local_experts") or cfg.get("num_experts") or 0


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    kind = cfg["model_type"]
    attention_family, _, _ = LAYOUT[kind]
    window = _window(cfg, kind)
    layer_type = SLIDING if window is not None else FULL
    # Attention, norms and the dense feed-forward as the dense sibling family reads them.
    dense = block_from_config({**cfg, "sliding_window": window}, attention_family, layer_type)
    act = _activation(cfg, attention_family, _family(attention_family))
    hidden = cfg["intermediate_size"] if kind == "mixtral" else cfg["moe_intermediate_size"]
    normalize = True if kind == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    if cfg.get("num_experts_per_tok") is None or not _experts(cfg):
        raise ConfigError(f"{kind}: config.json names no experts (num_local_experts, num_experts_per_tok)")
    moe = MoE(experts=_experts(cfg), top_k=cfg["num_experts_per_tok"], expert=GLU(hidden=hidden, act=act),
              router=Router(score="softmax", normalize=normalize))
    layers = [dense.model_copy(update={"mlp": moe}) if _is_moe_layer(cfg, kind, i) else dense
              for i in range(cfg["num_hidden_layers"])]
    names = block_names(layers, ["moe" if isinstance(b.mlp, MoE) else "dense" for b in layers])
    return ModelSpec(
        name=name, vocab=cfg["vocab_size"], d_model=cfg["hidden_size"], max_seq=cfg["max_position_embeddings"],
        embedding=Embedding(tied=cfg.get("tie_word_embeddings", False)),
        final_norm=RMSNorm(eps=cfg.get("rms_norm_eps", 1e-6)), param_dtype=param_dtype or config_dtype(cfg),
        compute_dtype="bfloat16", blocks=dict(zip(names, layers)), layers=tuple(segments(names)))


def _family(kind: str):
    from mxc.compiler.hf.config_in import FAMILIES

    return FAMILIES[kind]


def _kind(spec: ModelSpec) -> str:
    return "qwen3_moe" if any(b.attention.qk_norm is not None for b in spec.blocks.values()) else "mixtral"


def describes(spec: ModelSpec) -> bool:
    blocks = list(spec.blocks.values())
    if not any(isinstance(b.mlp, MoE) for b in blocks):
        return False
    for block in blocks:
        att, ffn = block.attention, block.mlp
        if isinstance(att, MLA) or att.sinks or att.chunk or att.temperature_tuning or att.rope is None:
            return False
        if isinstance(ffn, MoE):
            r = ffn.router
            if (not isinstance(ffn.expert, GLU) or ffn.shared_experts or r.score != "softmax" or r.bias
                    or r.groups > 1 or r.correction_bias or r.routed_scale != 1 or r.weight_on != "output"):
                return False
    return True


def config_from_spec(spec: ModelSpec) -> dict:
    kind = _kind(spec)
    layers = [spec.blocks[name] for name in spec.layer_kinds]
    moe = next(b.mlp for b in layers if isinstance(b.mlp, MoE))
    dense = [i for i, b in enumerate(layers) if not isinstance(b.mlp, MoE)]
    att = layers[0].attention
    windows = {b.attention.window for b in layers}
    if len(windows) > 1:
        raise LayoutError(f"{kind} configs hold one sliding window for every layer; this spec has several")
    window = windows.pop()
    cfg = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": spec.vocab, "hidden_size": spec.d_model, "num_hidden_layers": len(layers),
        "num_attention_heads": att.heads, "num_key_value_heads": att.kv_heads, "head_dim": att.head_dim,
        "max_position_embeddings": spec.max_seq, "rms_norm_eps": spec.final_norm.eps,
        "tie_word_embeddings": spec.embedding.tied, "dtype": spec.param_dtype,
        "hidden_act": HF_ACTIVATIONS[moe.expert.act], "rope_parameters": rope_parameters(att.rope),
        "num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k, "sliding_window": window,
    }
    if kind == "mixtral":
        cfg["intermediate_size"] = moe.expert.hidden
    else:
        cfg.update(attention_bias=att.qkv_bias, moe_intermediate_size=moe.expert.hidden,
                   intermediate_size=layers[dense[0]].mlp.hidden if dense else moe.expert.hidden,
                   norm_topk_prob=moe.router.normalize, decoder_sparse_step=1, mlp_only_layers=dense,
                   use_sliding_window=window is not None)
    check_round_trip(spec, cfg)
    return cfg


def tensor_maps(spec: ModelSpec) -> Iterator:
    _, module, names = LAYOUT[_kind(spec)]

    def feed_forward_maps(entry, ffn, where: str) -> Iterator:
        if isinstance(ffn, MoE):
            yield entry(f"{module}.gate.weight", ("mlp", "router", "kernel"), (_transpose, _transpose))
            for expert in range(ffn.experts):
                for proj, hf_name in zip(("gate", "up", "down"), names):
                    yield entry(f"{module}.experts.{expert}.{hf_name}.weight", ("mlp", "experts", proj, "kernel"),
                                (_transpose, _transpose), index=(expert,))
        else:
            for proj in ("gate", "up", "down"):
                yield entry(f"mlp.{proj}_proj.weight", ("mlp", proj, "kernel"), (_transpose, _transpose))

    return decoder_maps(spec, feed_forward_maps)


CONVERTER = FamilyConverter(model_types=tuple(LAYOUT), architectures=ARCHITECTURES,
                            spec_from_config=spec_from_config, config_from_spec=config_from_spec,
                            describes=describes, tensor_maps=tensor_maps)
