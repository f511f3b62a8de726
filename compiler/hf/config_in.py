"""A HuggingFace config.json (as a dict) to a ModelSpec, for the dense families mxc imports.

Both spellings are read: the hub's (rope_theta, rope_scaling, rope_local_base_freq,
sliding_window_pattern, torch_dtype) and transformers 5's (rope_parameters, possibly nested per
layer type, layer_types, dtype). Every reading follows the transformers 5.23 modeling code of the
family, including its quirks (noted where they matter).
"""

from __future__ import annotations

from dataclasses import dataclass

from mxc.spec.ir import (GLU, GQA, MHA, MQA, Block, Embedding, LinearScaling, Llama3Scaling, LongRopeScaling,
                         ModelSpec, RMSNorm, Rope, Segment, YarnScaling)

FULL, SLIDING = "full_attention", "sliding_attention"


class ConfigError(ValueError):
    """config.json describes something mxc does not import."""


@dataclass(frozen=True)
class Family:
    """What distinguishes one HF model type from Llama's."""

    gemma: bool = False  # zero-centred norms, sqrt(d_model) embedding scale, tied by default
    post_norm: bool = False  # Gemma 2/3's extra norms after attention and feed-forward
    qk_norm: bool = False
    attention_softcap: bool = False
    scalar: bool = False  # query_pre_attn_scalar
    activation_key: str = "hidden_act"
    attention_bias: bool = True  # config.attention_bias exists
    mlp_bias: bool = False  # config.mlp_bias exists
    tied_default: bool = False
    final_softcap: bool = False  # final_logit_softcapping
    qkv_bias: bool = False  # biases on q, k and v always (Qwen2), none on o


FAMILIES = {
    "llama": Family(mlp_bias=True),
    "mistral": Family(attention_bias=False),
    "qwen2": Family(attention_bias=False, qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    # Phi-3's fused projections are split and fused again in compiler/hf/phi3.py; its config reads as Llama's.
    "phi3": Family(attention_bias=False),
    "gemma": Family(gemma=True, tied_default=True),
    "gemma2": Family(gemma=True, post_norm=True, attention_softcap=True, scalar=True,
                     activation_key="hidden_activation", tied_default=True, final_softcap=True),
    # Gemma 3's attention module never passes attn_logit_softcapping to its kernel, so it is not read.
    "gemma3_text": Family(gemma=True, post_norm=True, qk_norm=True, scalar=True,
                          activation_key="hidden_activation", tied_default=True, final_softcap=True),
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu": "gelu", "relu": "relu"}

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


MULTIMODAL = {"gemma3": "gemma3_text", "llama4": "llama4_text"}  # multimodal type -> its text model's


def square_size(section: dict, key: str, default, refusal: str):
    """A vision config's size, which transformers writes as one number or as [height, width]: mxc's
    towers take square images, tiles and patches, so unequal sides are a ConfigError (`refusal`
    says what the tower takes)."""
    value = section.get(key, default)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"vision_config.{key} {value}: {refusal}")
        value = value[0]
    return value


def model_type(cfg: dict) -> str:
    from mxc.compiler.hf.families import model_types

    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        hint = ""
        if kind in MULTIMODAL:
            hint = f" (a multimodal model: import its text model, model_type {MULTIMODAL[kind]})"
        known = list(dict.fromkeys([*FAMILIES, *model_types()]))
        raise ConfigError(f"model_type '{kind}' is not imported{hint}; mxc imports: {', '.join(known)}")
    return kind


def layer_types(cfg: dict, kind: str) -> list[str]:
    """full_attention / sliding_attention per layer, derived the way each config class does."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    elif kind in ("mistral", "phi3"):
        types = [SLIDING if cfg.get("sliding_window") else FULL] * n
    elif kind in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        first = cfg.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    elif kind == "gemma2":
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    elif kind == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    else:
        types = [FULL] * n
    if len(types) != n or set(types) - {FULL, SLIDING}:
        raise ConfigError(f"layer_types must name full_attention or sliding_attention for each of the {n} layers")
    return types


def _rope_dict(cfg: dict, kind: str, layer_type: str) -> dict:
    params = cfg.get("rope_parameters")
    if params and (FULL in params or SLIDING in params):
        entry = dict(params.get(layer_type) or {})
    elif params:
        entry = dict(params)
    else:
        entry = dict(cfg.get("rope_scaling") or {})
        if kind == "gemma3_text" and layer_type == SLIDING:
            # The hub's Gemma 3 scales only its global layers; local ones use rope_local_base_freq.
            entry = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if "rope_theta" not in entry:
        if kind == "gemma3_text":
            entry["rope_theta"] = (cfg.get("rope_theta", 1_000_000.0) if layer_type == FULL
                                   else cfg.get("rope_local_base_freq", 10_000.0))
        else:
            entry["rope_theta"] = cfg.get("rope_theta", 10_000.0)
    return entry


def rope_from_config(cfg: dict, kind: str, layer_type: str) -> Rope:
    entry = _rope_dict(cfg, kind, layer_type)
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if kind == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config reads the names of its early checkpoints so
    partial = entry.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial} is not imported (rotary on the whole head only)")
    theta = float(entry["rope_theta"])
    original = entry.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "linear":
        scaling = LinearScaling(factor=entry["factor"])
    elif rope_type == "llama3":
        scaling = Llama3Scaling(factor=entry["factor"], low_freq=entry["low_freq_factor"],
                                high_freq=entry["high_freq_factor"], original_max_seq=original)
    elif rope_type == "yarn":
        if entry.get("attention_factor") is not None:
            raise ConfigError("yarn with an explicit attention_factor is not imported")
        factor = entry.get("factor") or cfg["max_position_embeddings"] / original
        scaling = YarnScaling(factor=factor, original_max_seq=original,
                              beta_fast=entry.get("beta_fast") or 32.0, beta_slow=entry.get("beta_slow") or 1.0,
                              mscale=entry.get("mscale") or 1.0, mscale_all_dim=entry.get("mscale_all_dim") or 0.0,
                              truncate=entry.get("truncate", True))
    elif rope_type == "longrope":
        # Phi-3 states original_max_position_embeddings beside the rope entry and no factor: the
        # factor is then the context extension (transformers' _compute_longrope_parameters).
        original = entry.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if original is None:
            raise ConfigError("longrope needs original_max_position_embeddings")
        scaling = LongRopeScaling(short_factor=tuple(entry["short_factor"]), long_factor=tuple(entry["long_factor"]),
                                  original_max_seq=original,
                                  factor=entry.get("factor") or cfg["max_position_embeddings"] / original,
                                  attention_factor=entry.get("attention_factor"))
    else:
        raise ConfigError(f"rope_type '{rope_type}' is not imported; mxc imports default, linear, llama3, yarn "
                          "and longrope")
    return Rope(theta=theta, scaling=scaling)


def _activation(cfg: dict, kind: str, family: Family) -> str:
    name = cfg.get(family.activation_key) or cfg.get("hidden_act") or "silu"
    if kind == "gemma" and name == "gelu":
        name = "gelu_pytorch_tanh"  # GemmaConfig rewrites the hub's legacy "gelu" to the tanh form
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation '{name}' is not imported; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def block_from_config(cfg: dict, kind: str, layer_type: str) -> Block:
    family = FAMILIES[kind]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps = cfg.get("rms_norm_eps", 1e-6)
    norm = RMSNorm(eps=eps, zero_centered=family.gemma)
    bias = bool(cfg.get("attention_bias", False)) if family.attention_bias else False
    fields = dict(heads=heads, head_dim=head_dim, rope=rope_from_config(cfg, kind, layer_type),
                  qkv_bias=bias or family.qkv_bias, out_bias=bias)
    if layer_type == SLIDING:
        fields["window"] = cfg["sliding_window"]
    if family.qk_norm:
        fields["qk_norm"] = norm
    if family.attention_softcap and cfg.get("attn_logit_softcapping") is not None:
        fields["softcap"] = cfg["attn_logit_softcapping"]
    if family.scalar:
        fields["query_pre_attn_scalar"] = cfg.get("query_pre_attn_scalar", 256)
    if kv_heads == heads:
        attention = MHA(**fields)
    elif kv_heads == 1:
        attention = MQA(**fields)
    else:
        attention = GQA(kv_heads=kv_heads, **fields)
    mlp = GLU(hidden=cfg["intermediate_size"], act=_activation(cfg, kind, family),
              bias=bool(cfg.get("mlp_bias", False)) if family.mlp_bias else False)
    return Block(attention=attention, mlp=mlp, norm=norm, post_norm=norm if family.post_norm else None)


def segments(kinds: list[str]) -> list[Segment]:
    """Cover the layer sequence with repeating periods, greedily: at each point take the period
    that repeats (twice or more) over the most layers, else a single layer."""
    out, i = [], 0
    while i < len(kinds):
        best_period, best_repeat = 1, 1
        for period in range(1, (len(kinds) - i) // 2 + 1):
            repeat = 1
            while kinds[i + repeat * period:i + (repeat + 1) * period] == kinds[i:i + period]:
                repeat += 1
            if repeat >= 2 and period * repeat > best_period * best_repeat:
                best_period, best_repeat = period, repeat
        out.append(Segment(period=tuple(kinds[i:i + best_period]), repeat=best_repeat))
        i += best_period * best_repeat
    return out


def _block_names(blocks: list[Block], types: list[str]) -> list[str]:
    """One name per distinct block: `block` when all layers agree, else local/global by layer type."""
    distinct = []
    for block in blocks:
        if block not in distinct:
            distinct.append(block)
    if len(distinct) == 1:
        return ["block"] * len(blocks)
    names: list[str] = []
    for block in distinct:
        base = "local" if types[blocks.index(block)] == SLIDING else "global"
        same_base = sum(1 for n in names if n.rstrip("0123456789") == base)
        names.append(base if same_base == 0 else f"{base}{same_base + 1}")
    return [names[distinct.index(block)] for block in blocks]


def config_dtype(cfg: dict) -> str:
    return DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), "float32")


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of a HF causal LM config. param_dtype defaults to the config's dtype; the
    compute dtype is the parameters' (a float32 checkpoint computes in float32: on CPU, bfloat16
    compute is emulated by converting the weights at every step)."""
    from mxc.compiler.hf.families import converter_for_model_type

    converter = converter_for_model_type(cfg.get("model_type"))
    if converter is not None:
        spec = converter.spec_from_config(cfg, name, param_dtype)
        return spec.model_copy(update={"compute_dtype": spec.param_dtype})
    return dense_spec_from_config(cfg, model_type(cfg), name, param_dtype)


def dense_spec_from_config(cfg: dict, kind: str, name: str, param_dtype: str | None = None) -> ModelSpec:
    """The spec of a config of one of the FAMILIES (read as `kind`)."""
    family = FAMILIES[kind]
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional attention (use_bidirectional_attention) is not imported")
    types = layer_types(cfg, kind)
    blocks = [block_from_config(cfg, kind, t) for t in types]
    names = _block_names(blocks, types)
    dtype = param_dtype or config_dtype(cfg)
    tied = cfg.get("tie_word_embeddings", family.tied_default)
    return ModelSpec(
        name=name, vocab=cfg["vocab_size"], d_model=cfg["hidden_size"], max_seq=cfg["max_position_embeddings"],
        embedding=Embedding(tied=tied, scale="sqrt_d_model" if family.gemma else "none"),
        final_norm=RMSNorm(eps=cfg.get("rms_norm_eps", 1e-6), zero_centered=family.gemma),
        final_softcap=cfg.get("final_logit_softcapping") if family.final_softcap else None,
        param_dtype=dtype, compute_dtype=dtype,
        blocks={n: b for n, b in zip(names, blocks)}, layers=tuple(segments(names)))
