"""GGUF architectures as HuggingFace configs and tensors, so the HF importer's spec reading and
tensor placement (compiler/hf) serve GGUF files too.

Names and conventions follow llama.cpp's convert_hf_to_gguf.py (the writer of these files):
- tensors are named `token_embd`, `blk.N.attn_q`, ... (HF_NAMES below);
- for the llama family (rotary on interleaved pairs in llama.cpp) the converter permutes the
  rows of attn_q and attn_k within each head; `unpermute` undoes it, as transformers' GGUF
  loader does, so the weights rotate halves again like HF's;
- Gemma's RMSNorm scales are stored as 1 + w (llama.cpp's norm multiplies by the scale), so
  1 is taken off again;
- experts are stacked in one tensor per projection (`ffn_gate_exps`, [experts, out, in]).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mxc.compiler.gguf.file import GGUFError, GGUFFile


@dataclass(frozen=True)
class Architecture:
    model_type: str  # the HF config's model_type
    permuted_qk: bool = False  # llama.cpp permuted q/k rows (llama-family rotary)
    gemma: bool = False  # norms stored as 1 + w; gelu-tanh MLP


ARCHITECTURES = {
    "llama": Architecture("llama", permuted_qk=True),
    "mistral": Architecture("mistral", permuted_qk=True),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "qwen3moe": Architecture("qwen3_moe"),
    "gemma": Architecture("gemma", gemma=True),
    "gemma2": Architecture("gemma2", gemma=True),
    "gemma3": Architecture("gemma3_text", gemma=True),
}
# A llama file with experts is Mixtral's layout (llama.cpp writes Mixtral as llama).
MIXTRAL = Architecture("mixtral", permuted_qk=True)

# The metadata keys under `{arch}.` and the HF config keys they fill.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_local_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

# GGUF tensor name (after `blk.N.`) -> HF name (after `model.layers.N.`); {mlp} is the MoE
# module's name. Gemma 2/3 name their norms differently (GEMMA_NORMS).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Stacked expert tensors -> (the HF module, the projection's HF name) per MoE layout.
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    "qwen3_moe": ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
}
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def architecture_of(gguf: GGUFFile) -> Architecture:
    name = gguf.architecture
    if name not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: architecture '{name}' is not imported; mxc imports "
                        f"{', '.join(ARCHITECTURES)} (and llama files with experts, as Mixtral)")
    if name == "llama" and gguf.metadata.get("llama.expert_count"):
        return MIXTRAL
    return ARCHITECTURES[name]


def _scalar(value, key: str, gguf: GGUFFile):
    if isinstance(value, list):
        raise GGUFError(f"{gguf.path}: {key} differs between layers ({value[:4]}...); mxc imports one value "
                        "for every layer")
    return value


def hf_config(gguf: GGUFFile, param_dtype: str) -> dict:
    """The HF config.json (as a dict) of the model the GGUF file holds."""
    arch = architecture_of(gguf)
    prefix = gguf.architecture + "."
    meta = gguf.metadata
    cfg: dict = {"model_type": arch.model_type, "dtype": param_dtype,
                 "_name_or_path": str(meta.get("general.name") or gguf.path.stem)}
    for key, hf_key in CONFIG_KEYS.items():
        if prefix + key in meta:
            cfg[hf_key] = _scalar(meta[prefix + key], prefix + key, gguf)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
               if k not in cfg]
    if missing:
        raise GGUFError(f"{gguf.path}: the metadata lacks {', '.join(prefix + _gguf_key(k) for k in missing)}")
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{gguf.path}: no token_embd.weight tensor")
    cfg["vocab_size"] = meta.get(prefix + "vocab_size") or embedding.shape[0]
    cfg.setdefault("max_position_embeddings", 2048)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    heads = cfg["num_attention_heads"]
    cfg.setdefault("head_dim", cfg["hidden_size"] // heads)
    cfg.setdefault("num_key_value_heads", heads)
    cfg["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    cfg.update(_rope_scaling(gguf, prefix, cfg))
    if arch.gemma:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["hidden_act"] = "gelu_pytorch_tanh"
        # llama.cpp scales Gemma 2/3 queries by 1/sqrt(key_length), but the 27B models (46 and 62
        # layers) by 1/sqrt(hidden / heads) (llama-model.cpp, f_attention_scale).
        big = (arch.model_type, cfg["num_hidden_layers"]) in (("gemma2", 46), ("gemma3_text", 62))
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // heads if big else cfg["head_dim"]
        if arch.model_type == "gemma3_text":
            cfg["rope_local_base_freq"] = 10_000.0
            cfg["sliding_window_pattern"] = int(meta.get(prefix + "attention.sliding_window_pattern", 6))
    else:
        cfg["hidden_act"] = "silu"
    if arch.model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("sliding_window"):
        cfg["use_sliding_window"] = True
    if arch.model_type == "qwen3_moe":
        cfg["norm_topk_prob"] = True  # llama.cpp's qwen3moe always renormalises the top-k weights
    return cfg


def _gguf_key(hf_key: str) -> str:
    return next(k for k, v in CONFIG_KEYS.items() if v == hf_key)


def _rope_scaling(gguf: GGUFFile, prefix: str, cfg: dict) -> dict:
    meta = gguf.metadata
    kind = meta.get(prefix + "rope.scaling.type")
    if "rope_freqs.weight" in gguf.tensors:
        return {"rope_scaling": _llama3_scaling(gguf, cfg)}
    if kind in (None, "none"):
        return {}
    factor = meta.get(prefix + "rope.scaling.factor")
    original = meta.get(prefix + "rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if kind == "yarn":
        return {"rope_scaling": {"rope_type": "yarn", "factor": factor,
                                 "original_max_position_embeddings": original}}
    raise GGUFError(f"{gguf.path}: rope scaling '{kind}' is not imported; mxc imports linear and yarn")


# Llama 3.1's rope scaling, the one llama.cpp's converter turns into a rope_freqs tensor.
LLAMA3_SCALINGS = ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192},
                   {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192})


def _llama3_scaling(gguf: GGUFFile, cfg: dict) -> dict:
    """llama.cpp stores Llama 3's rope scaling as per-frequency divisors (rope_freqs); the
    parameters are the known ones whose divisors these are."""
    stored = gguf.dequantized("rope_freqs.weight")
    base, dim = cfg["rope_theta"], cfg["head_dim"]
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for params in LLAMA3_SCALINGS:
        if stored.shape == inv_freq.shape and np.allclose(stored, _llama3_divisors(inv_freq, params), rtol=1e-5):
            return {"rope_type": "llama3", **params}
    raise GGUFError(f"{gguf.path}: rope_freqs.weight matches no known Llama 3 rope scaling")


def _llama3_divisors(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors.
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(out)


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows [heads * head_dim, ...], within each head the
    even rows first, then the odd ones) back to HF's order."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class HFTensors(Mapping):
    """Every tensor of the file under its HF name, in HF's layout and `dtype`, dequantized when
    asked for (one expert of a stacked tensor alone): the import holds the parameters and one
    tensor at a time, not a second copy of the whole model."""

    def __init__(self, gguf: GGUFFile, cfg: dict, dtype):
        self.gguf, self.cfg, self.dtype = gguf, cfg, dtype
        self.arch = architecture_of(gguf)
        self.sources: dict[str, tuple[str, int | None]] = {}  # HF name -> (file tensor, expert)
        for name, tensor in gguf.tensors.items():
            if name == "rope_freqs.weight":
                continue  # read into the config's rope scaling
            for hf_name, expert in _hf_names(name, tensor.shape, self.arch, gguf):
                self.sources[hf_name] = (name, expert)

    def __getitem__(self, hf_name: str) -> np.ndarray:
        name, expert = self.sources[hf_name]
        value = _to_hf(name, self.gguf.dequantized(name, np.float32, expert), self.arch, self.cfg)
        return value.astype(self.dtype, copy=False)

    def __iter__(self):
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def hf_tensors(gguf: GGUFFile, cfg: dict, dtype) -> HFTensors:
    return HFTensors(gguf, cfg, dtype)


def _layer_part(name: str, gguf: GGUFFile) -> tuple[str, str, str]:
    match = LAYER_TENSOR.match(name)
    if not match:
        raise GGUFError(f"{gguf.path}: tensor {name} has no place in a {gguf.architecture} model")
    return match.groups()


def _hf_names(name: str, shape: tuple, arch: Architecture, gguf: GGUFFile):
    """(HF name, expert index or None) for each HF tensor the file tensor `name` holds."""
    stem, _, kind = name.rpartition(".")
    if stem in TOP_NAMES and kind == "weight":
        yield f"{TOP_NAMES[stem]}.weight", None
        return
    layer, part, kind = _layer_part(name, gguf)
    prefix = f"model.layers.{layer}."
    if part in EXPERT_NAMES.get(arch.model_type, ("", {}))[1]:
        module, names = EXPERT_NAMES[arch.model_type]
        for expert in range(shape[0]):
            yield f"{prefix}{module}.experts.{expert}.{names[part]}.{kind}", expert
        return
    if part == "ffn_gate_inp" and arch.model_type in EXPERT_NAMES:
        yield f"{prefix}{EXPERT_NAMES[arch.model_type][0]}.gate.{kind}", None
        return
    names = {**LAYER_NAMES, **GEMMA_NORMS} if arch.model_type in ("gemma2", "gemma3_text") else LAYER_NAMES
    if part not in names:
        raise GGUFError(f"{gguf.path}: tensor {name} has no place in a {gguf.architecture} model")
    yield prefix + names[part] + "." + kind, None


def _to_hf(name: str, value: np.ndarray, arch: Architecture, cfg: dict) -> np.ndarray:
    """A file tensor's values in HF's convention: Gemma's norms less 1, llama q/k rows unpermuted."""
    stem = name.rpartition(".")[0]
    part = stem.rpartition(".")[2]
    if arch.gemma and (stem == "output_norm" or (stem.startswith("blk.") and part.endswith("norm"))):
        return value - 1
    if arch.permuted_qk and stem.startswith("blk.") and part == "attn_q":
        return unpermute(value, cfg["num_attention_heads"])
    if arch.permuted_qk and stem.startswith("blk.") and part == "attn_k":
        return unpermute(value, cfg["num_key_value_heads"])
    return value
