"""Writes a tiny Hugging Face Llama checkpoint (config.json, model.safetensors) and a token file.

    python tiny_hf_llama.py DIRECTORY

Every weight is 0.01: enough for import-hf and forward to run, not for any numeric check. The
tokens, arange(16) as 2 rows of 8, go to tokens.npy beside DIRECTORY."""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 16, 128, 128


def main(directory: str) -> None:
    d = Path(directory)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}))

    def w(*shape):
        return np.full(shape, 0.01, np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN),
               "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE), p + "input_layernorm.weight": w(HIDDEN),
            p + "post_attention_layernorm.weight": w(HIDDEN)})
    save_file(tensors, str(d / "model.safetensors"))
    np.save(d.parent / "tokens.npy", np.arange(16).reshape(2, 8))


if __name__ == "__main__":
    main(sys.argv[1])
