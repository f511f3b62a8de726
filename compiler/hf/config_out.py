"""A ModelSpec to a HuggingFace config.json (transformers 5 spelling), for specs without an
original config to write back (a model trained from scratch).

The family is read off the spec's features; the result is checked by reading it back with
config_in, so a spec that no HF config describes exactly is refused rather than approximated.
"""

from __future__ import annotations

from mxc.compiler.hf.config_in import FULL, SLIDING, spec_from_config
from mxc.compiler.hf.mapping import LayoutError
from mxc.spec.ir import LinearScaling, Llama3Scaling, LongRopeScaling, ModelSpec, Rope, YarnScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
HF_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}


def family_of(spec: ModelSpec) -> str:
    blocks = list(spec.blocks.values())
    first = blocks[0]
    if spec.embedding.scale == "sqrt_d_model":
        if first.attention.qk_norm is not None:
            return "gemma3_text"
        return "gemma2" if first.post_norm is not None else "gemma"
    if first.attention.qk_norm is not None:
        return "qwen3"
    if first.attention.qkv_bias and not first.attention.out_bias:
        return "qwen2"  # biases on q, k and v only; Llama's attention_bias puts one on o too
    if all(b.attention.window is not None for b in blocks):
        return "mistral"
    return "llama"


def rope_parameters(rope: Rope | None) -> dict:
    if rope is None:
        raise LayoutError("layers without rope (NoPE) have no counterpart in the HF families mxc converts")
    params = {"rope_theta": rope.theta, "rope_type": "default"}
    s = rope.scaling
    if isinstance(s, LinearScaling):
        params.update(rope_type="linear", factor=s.factor)
    elif isinstance(s, Llama3Scaling):
        params.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq,
                      high_freq_factor=s.high_freq, original_max_position_embeddings=s.original_max_seq)
    elif isinstance(s, YarnScaling):
        params.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_seq,
                      beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=s.mscale,
                      mscale_all_dim=s.mscale_all_dim, truncate=s.truncate)
    elif isinstance(s, LongRopeScaling):
        params.update(rope_type="longrope", short_factor=list(s.short_factor), long_factor=list(s.long_factor),
                      original_max_position_embeddings=s.original_max_seq, factor=s.factor)
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
    return params


def config_from_spec(spec: ModelSpec) -> dict:
    from mxc.compiler.hf.families import converter_for_spec

    parallel = [name for name in spec.layer_kinds if spec.blocks[name].parallel]
    if parallel:
        raise LayoutError(f"block '{parallel[0]}' is parallel (attention and feed-forward on one normed input); "
                          "none of the HF families mxc exports has that layer")

    converter = converter_for_spec(spec)
    if converter is not None:
        return converter.config_from_spec(spec)
    return dense_config(spec, family_of(spec))


def dense_config(spec: ModelSpec, kind: str) -> dict:
    """The config.json of `spec` as a model of `kind` (one of config_in's FAMILIES)."""
    layers = [spec.blocks[name] for name in spec.layer_kinds]
    types = [SLIDING if b.attention.window is not None else FULL for b in layers]
    first = layers[0]
    att = first.attention
    cfg = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": spec.vocab, "hidden_size": spec.d_model, "intermediate_size": first.mlp.hidden,
        "num_hidden_layers": len(layers), "num_attention_heads": att.heads,
        "num_key_value_heads": att.kv_heads, "head_dim": att.head_dim,
        "max_position_embeddings": spec.max_seq, "rms_norm_eps": spec.final_norm.eps,
        "tie_word_embeddings": spec.embedding.tied, "dtype": spec.param_dtype,
        "attention_bias": att.qkv_bias,
    }
    activation = HF_ACTIVATIONS[first.mlp.act]
    cfg["hidden_activation" if kind in ("gemma2", "gemma3_text") else "hidden_act"] = activation
    if kind == "llama":
        cfg["mlp_bias"] = first.mlp.bias
    if kind in ("mistral", "qwen2", "phi3"):
        del cfg["attention_bias"]  # fixed by the family: none (Mistral, Phi-3), on q, k, v (Qwen2)
    windows = {b.attention.window for b in layers} - {None}
    if len(windows) > 1:
        raise LayoutError(f"HF configs hold one sliding_window; this spec has {sorted(windows)}")
    cfg["sliding_window"] = windows.pop() if windows else None
    if kind in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        cfg["layer_types"] = types
    if kind in ("qwen2", "qwen3") and cfg["sliding_window"] is not None:
        cfg["use_sliding_window"] = True
        cfg["max_window_layers"] = types.index(SLIDING)
    if kind in ("gemma2", "gemma3_text"):
        scalar = att.query_pre_attn_scalar
        cfg["query_pre_attn_scalar"] = int(scalar) if scalar is not None and scalar.is_integer() else scalar
        cfg["final_logit_softcapping"] = spec.final_softcap
    if kind == "gemma2":
        cfg["attn_logit_softcapping"] = att.softcap
    if kind == "gemma3_text":
        by_type = {}
        for block, layer_type in zip(layers, types):
            by_type.setdefault(layer_type, rope_parameters(block.attention.rope))
        by_type.setdefault(FULL, by_type.get(SLIDING))
        by_type.setdefault(SLIDING, by_type[FULL])
        cfg["rope_parameters"] = by_type
    else:
        cfg["rope_parameters"] = rope_parameters(att.rope)
    check_round_trip(spec, cfg)
    return cfg


def check_round_trip(spec: ModelSpec, cfg: dict) -> None:
    """Refuse a config that does not read back as `spec` (up to compute dtype and sharding)."""
    back = spec_from_config(cfg, spec.name, spec.param_dtype)
    mine = spec.model_copy(update={"compute_dtype": back.compute_dtype, "shard": {}, "mesh": {}})
    if back.layer_kinds and [back.blocks[k] for k in back.layer_kinds] == [mine.blocks[k] for k in mine.layer_kinds] \
            and back.model_copy(update={"blocks": mine.blocks, "layers": mine.layers}) == mine:
        return
    raise LayoutError(f"no {cfg['model_type']} config.json describes '{spec.name}' exactly (HF configs share one "
                      "size, norm and rope per layer type across all layers)")
