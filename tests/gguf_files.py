"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from random
transformers models: the references of the GGUF import tests.

The conventions are llama.cpp's, restated here on their own (not imported from mxc): tensor
names (`blk.N.attn_q`, ...), the llama family's q/k row permutation (rotary on interleaved
pairs), Gemma's norm scales stored as 1 + w, experts stacked per projection, and GGUF's
metadata keys. A small byte-level BPE vocabulary rides along, as every real file has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

VOCAB = 260  # the 256 bytes and four control tokens
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 64, 96, 4, 2, 16, 128


@dataclass(frozen=True)
class TinyModel:
    arch: str  # general.architecture
    config_class: str  # transformers' config class
    config: dict = field(default_factory=dict)
    permuted: bool = False  # llama.cpp permutes q/k rows
    gemma_norms: bool = False  # norms stored as 1 + w
    gemma_names: bool = False  # Gemma 2/3's four norms per layer
    experts: str | None = None  # the HF MoE module's expert naming: mixtral or qwen3_moe
    layers: int = 2


BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
GEMMA = dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
MODELS = {
    "llama": TinyModel("llama", "LlamaConfig", dict(rope_theta=10_000.0), permuted=True),
    # Llama 3.1's rope scaling, which llama.cpp stores as a rope_freqs tensor.
    "llama3": TinyModel("llama", "LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), permuted=True),
    "mistral": TinyModel("mistral", "MistralConfig", dict(rope_theta=10_000.0, sliding_window=None), permuted=True),
    "qwen2": TinyModel("qwen2", "Qwen2Config", dict(rope_theta=10_000.0)),
    "qwen3": TinyModel("qwen3", "Qwen3Config", dict(rope_theta=10_000.0)),
    "gemma": TinyModel("gemma", "GemmaConfig", dict(GEMMA), gemma_norms=True),
    "gemma2": TinyModel("gemma2", "Gemma2Config", dict(GEMMA, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
                                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                        gemma_norms=True, gemma_names=True),
    "gemma3": TinyModel("gemma3", "Gemma3TextConfig", dict(GEMMA, query_pre_attn_scalar=HEAD_DIM, sliding_window=8,
                                                            sliding_window_pattern=6, rope_local_base_freq=10_000.0),
                        gemma_norms=True, gemma_names=True, layers=6),
    "mixtral": TinyModel("llama", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                         sliding_window=None), permuted=True, experts="mixtral"),
    "qwen3moe": TinyModel("qwen3moe", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                            moe_intermediate_size=32, decoder_sparse_step=1),
                          experts="qwen3_moe"),
}
CAUSAL_LM = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
             "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM", "GemmaConfig": "GemmaForCausalLM",
             "Gemma2Config": "Gemma2ForCausalLM", "Gemma3TextConfig": "Gemma3ForCausalLM",
             "MixtralConfig": "MixtralForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM"}

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def hf_model(name: str, seed: int = 0):
    import transformers

    case = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, case.config_class)(**{**BASE, "num_hidden_layers": case.layers, **case.config})
    model = getattr(transformers, CAUSAL_LM[case.config_class])(config).eval()
    with torch.no_grad():  # norms away from 1, so a lost or doubled offset shows
        for key, value in model.state_dict().items():
            if key.endswith("norm.weight"):
                value.copy_(torch.randn_like(value) * 0.3 + (0.0 if case.gemma_norms else 1.0))
    return model


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(name: str, model) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names and conventions, float32."""
    case = MODELS[name]
    cfg = model.config
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    out = {}
    layer_names = GEMMA_LAYER if case.gemma_names else LAYER
    for key, value in state.items():
        if key in TOP:
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[TOP[key]] = value + 1 if case.gemma_norms and key == "model.norm.weight" else value
            continue
        _, _, index, rest = key.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if case.experts:
            moe = _moe_module(state)
            if module == f"{moe}.gate":
                out[f"blk.{index}.ffn_gate_inp.{kind}"] = value
                continue
            if module == f"{moe}.experts" or module.startswith(f"{moe}.experts."):
                continue  # stacked below
        gguf_part = layer_names[module]
        if case.permuted and gguf_part == "attn_q":
            value = permute(value, cfg.num_attention_heads)
        elif case.permuted and gguf_part == "attn_k":
            value = permute(value, cfg.num_key_value_heads)
        if case.gemma_norms and gguf_part.endswith("norm"):
            value = value + 1
        out[f"blk.{index}.{gguf_part}.{kind}"] = value
    if case.experts:
        out.update(_stacked_experts(case, state, cfg))
    return out


def _moe_module(state: dict) -> str:
    # Mixtral's checkpoints name it block_sparse_moe; transformers 5's modules call it mlp.
    return "block_sparse_moe" if any(".block_sparse_moe." in k for k in state) else "mlp"


def _stacked_experts(case: TinyModel, state: dict, cfg) -> dict[str, np.ndarray]:
    module = _moe_module(state)
    names = ("w1", "w3", "w2") if module == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    experts = cfg.num_local_experts if case.experts == "mixtral" else cfg.num_experts
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for gguf_part, hf_name in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            key = f"model.layers.{layer}.{module}.experts.{{}}.{hf_name}.weight"
            if key.format(0) in state:
                out[f"blk.{layer}.{gguf_part}.weight"] = np.stack([state[key.format(e)] for e in range(experts)])
            else:  # transformers 5 keeps experts fused: gate_up_proj [E, 2F, D] and down_proj [E, D, F]
                fused = f"model.layers.{layer}.{module}.experts."
                if gguf_part == "ffn_down_exps":
                    out[f"blk.{layer}.{gguf_part}.weight"] = state[fused + "down_proj"]
                else:
                    gate_up = state[fused + "gate_up_proj"]
                    half = gate_up.shape[1] // 2
                    out[f"blk.{layer}.{gguf_part}.weight"] = (gate_up[:, :half] if gguf_part == "ffn_gate_exps"
                                                            else gate_up[:, half:])
    return out


def write_gguf(path: Path, name: str, model, tensor_type: str = "F32", tokenizer_pre: str | None = "default") -> Path:
    """A GGUF file of `model` (matrices stored as `tensor_type`, vectors as F32), with a byte-level
    tokenizer split as `tokenizer_pre` names (None: no tokenizer)."""
    import gguf

    case = MODELS[name]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), case.arch)
    arch = case.arch
    writer.add_name(f"tiny-{name}")
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta", getattr(cfg, "rope_theta", 10_000.0))
    writer.add_float32(f"{arch}.rope.freq_base", float(theta))
    if getattr(cfg, "sliding_window", None) and name.startswith("gemma"):
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if name == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    if case.experts:
        experts = cfg.num_local_experts if case.experts == "mixtral" else cfg.num_experts
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
        if case.experts == "qwen3_moe":
            writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if tokenizer_pre is not None:
        add_byte_tokenizer(writer, tokenizer_pre)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, cfg.head_dim))
    for tensor_name, value in gguf_tensors(name, model).items():
        add_tensor(writer, tensor_name, value, tensor_type if value.ndim >= 2 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one divisor per frequency."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def add_tensor(writer, name: str, value: np.ndarray, tensor_type: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[tensor_type]
    if tensor_type == "F32":
        writer.add_tensor(name, value.astype(np.float32))
    elif tensor_type == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)


def byte_tokens() -> list[str]:
    """GPT-2's byte alphabet (each byte's printable stand-in), then the control tokens."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            codes[byte] = chr(byte)
        else:
            codes[byte] = chr(256 + extra)
            extra += 1
    return [codes[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def add_byte_tokenizer(writer, pre: str) -> None:
    tokens = byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * 4)
    writer.add_token_merges([])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
