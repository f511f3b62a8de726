#!/usr/bin/env python3
"""Reference parameter counts for the zoo models added after param_counts.json was first made
(Llama 3, Llama 3.3, Qwen3-Coder, DeepSeek R1, Qwen2.5, Phi-3/3.5 mini), made the same way: each
model built on the meta device from its HF config.json values, every field read back unchanged,
parameters summed (a tied head once), active = total - MoE layers x (E - k) x one expert.

Usage: .venv/bin/python tests/data/param_counts_added.py   (rewrites these rows of param_counts.json;
       the other rows are kept as they are). Run by hand, never by the tests.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
import transformers as T

HERE = Path(__file__).resolve().parent
MT_YML = "AI-Hypercomputer/maxtext src/maxtext/configs/models/{}.yml @6aa8b844"


def llama(h, i, L, nh, nkv, V):
    return dict(hidden_size=h, intermediate_size=i, num_hidden_layers=L, num_attention_heads=nh,
                num_key_value_heads=nkv, vocab_size=V, tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False, head_dim=128)


def qwen2(h, i, L, nh, nkv):
    return dict(hidden_size=h, intermediate_size=i, num_hidden_layers=L, num_attention_heads=nh,
                num_key_value_heads=nkv, vocab_size=152064, tie_word_embeddings=False)


PHI3_MINI = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False)

MODELS = [
    dict(zoo="llama3-8b", name="Llama-3-8B", cls="LlamaForCausalLM", cfg=llama(4096, 14336, 32, 32, 8, 128256),
         published_total=8.0e9, pub_note="Llama 3 model card: nominal '8B' (HF Hub: 8.03B)",
         source=["HF meta-llama/Meta-Llama-3-8B config.json values (rope_theta 500000, no rope_scaling, "
                 "max_position_embeddings 8192)", MT_YML.format("llama3-8b")]),
    dict(zoo="llama3-70b", name="Llama-3-70B", cls="LlamaForCausalLM", cfg=llama(8192, 28672, 80, 64, 8, 128256),
         published_total=70.0e9, pub_note="Llama 3 model card: nominal '70B' (HF Hub: 70.6B)",
         source=["HF meta-llama/Meta-Llama-3-70B config.json values (rope_theta 500000, no rope_scaling, "
                 "max_position_embeddings 8192)", MT_YML.format("llama3-70b")]),
    dict(zoo="llama3.3-70b", name="Llama-3.3-70B", cls="LlamaForCausalLM", cfg=llama(8192, 28672, 80, 64, 8, 128256),
         published_total=70.0e9, pub_note="Llama 3.3 model card: nominal '70B'; the architecture of Llama 3.1 70B",
         source=["HF meta-llama/Llama-3.3-70B-Instruct config.json values (Llama 3.1 70B's, llama3 rope scaling)",
                 MT_YML.format("llama3.3-70b")]),
    dict(zoo="qwen3-coder-480b-a35b", name="Qwen3-Coder-480B-A35B", cls="Qwen3MoeForCausalLM",
         cfg=dict(hidden_size=6144, intermediate_size=8192, moe_intermediate_size=2560, num_hidden_layers=62,
                  num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151936, num_experts=160,
                  num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                  tie_word_embeddings=False, attention_bias=False),
         experts=("num_experts", "num_experts_per_tok"), published_total=480e9, published_active=35e9,
         pub_note="Qwen3-Coder model card: 480B total, 35B activated",
         source=["HF Qwen/Qwen3-Coder-480B-A35B-Instruct config.json values (rope_theta 1e7, "
                 "max_position_embeddings 262144)",
                 "slime scripts/models/qwen3-coder-480B-A35B.sh (Megatron arguments: 62 layers, 96 heads, 8 query "
                 "groups, kv-channels 128, hidden 6144, ffn 8192, vocab 151936)"]),
    dict(zoo="deepseek-r1", name="DeepSeek-R1", cls="DeepseekV3ForCausalLM",
         cfg=dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                  num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                  num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                  n_group=8, topk_group=4, tie_word_embeddings=False, attention_bias=False),
         experts=("n_routed_experts", "num_experts_per_tok"), published_total=671e9, published_active=37e9,
         pub_note="DeepSeek-R1 model card: 671B total, 37B activated (the DeepSeek-V3 architecture; MTP module "
                  "counted apart as for V3)",
         source=["HF deepseek-ai/DeepSeek-R1 config.json values (identical in shape to DeepSeek-V3's)"]),
    dict(zoo="qwen2.5-7b", name="Qwen2.5-7B", cls="Qwen2ForCausalLM", cfg=qwen2(3584, 18944, 28, 28, 4),
         published_total=7.61e9, pub_nonemb=6.53e9, pub_note="Qwen2.5-7B model card: 7.61B total, 6.53B non-embedding",
         source=["HF Qwen/Qwen2.5-7B config.json values (max_position_embeddings 131072, rms_norm_eps 1e-6, "
                 "rope_theta 1e6)"]),
    dict(zoo="qwen2.5-72b", name="Qwen2.5-72B", cls="Qwen2ForCausalLM", cfg=qwen2(8192, 29568, 80, 64, 8),
         published_total=72.7e9, pub_nonemb=70.0e9, pub_note="Qwen2.5-72B model card: 72.7B total, 70.0B non-embedding",
         source=["HF Qwen/Qwen2.5-72B config.json values (max_position_embeddings 131072, rms_norm_eps 1e-5, "
                 "rope_theta 1e6)"]),
    dict(zoo="phi-3-mini-128k", name="Phi-3-mini-128k", cls="Phi3ForCausalLM", cfg=dict(PHI3_MINI),
         published_total=3.8e9, pub_note="Phi-3-mini-128k-instruct model card: 3.8B",
         source=["HF microsoft/Phi-3-mini-128k-instruct config.json values (original_max_position_embeddings 4096, "
                 "max_position_embeddings 131072, longrope factors of the first release)",
                 "keras-team/keras-hub keras_hub/src/models/phi3/phi3_presets.py (3821079552 params)"]),
    dict(zoo="phi-3.5-mini", name="Phi-3.5-mini", cls="Phi3ForCausalLM", cfg=dict(PHI3_MINI),
         published_total=3.8e9, pub_note="Phi-3.5-mini-instruct model card: 3.8B",
         source=["HF microsoft/Phi-3.5-mini-instruct config.json values (verbatim copy in the code index, "
                 "id 23232855458)"]),
]

EXPLAIN = {
    "Llama-3-70B": "published figure is the nominal size label; exact count 70.55B (HF Hub: 70.6B)",
    "Llama-3.3-70B": "published figure is the nominal size label; exact count 70.55B",
    "DeepSeek-R1": "as DeepSeek-V3: only the count without the input embedding (36.63B) is close to 37B",
    "Qwen3-Coder-480B-A35B": "35.47B activated (incl. the 0.93B input embedding) rounds to the card's 35B",
    "Phi-3-mini-128k": "the card's 3.8B is rounded; exact count 3.821B (keras-hub's preset states 3821079552)",
    "Phi-3.5-mini": "the card's 3.8B is rounded; exact count 3.821B, as Phi-3-mini's",
}


def _category(name):
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".experts." in name:
        return "routed_experts"
    if "shared_expert" in name:
        return "shared_experts"
    if ".mlp.gate.weight" in name or ".router." in name:
        return "router"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    return "other"


def count(entry):
    cfg = getattr(T, entry["cls"]).config_class(**entry["cfg"])
    for key, value in entry["cfg"].items():
        assert getattr(cfg, key, "<missing>") == value, (entry["name"], key)
    with torch.device("meta"):
        model = getattr(T, entry["cls"])(cfg)
    total = sum(p.numel() for p in model.parameters())
    breakdown = {}
    for name, p in model.named_parameters():
        breakdown[_category(name)] = breakdown.get(_category(name), 0) + p.numel()
    active, moe = None, None
    if "experts" in entry:
        experts, top_k = (getattr(cfg, key) for key in entry["experts"])
        sizes = [sum(p.numel() for p in module.parameters()) for name, module in model.named_modules()
                 if name.endswith(".experts") and all(p.shape[0] == experts for p in module.parameters())]
        per_expert = sizes[0] // experts
        assert all(s == per_expert * experts for s in sizes) and breakdown["routed_experts"] == sum(sizes)
        active = total - len(sizes) * (experts - top_k) * per_expert
        moe = dict(moe_layers=len(sizes), num_routed_experts=experts, top_k=top_k, params_per_routed_expert=per_expert)
    del model
    gc.collect()
    return total, active, breakdown, moe


def pct(a, b):
    return None if a is None or not b else round(100.0 * (a - b) / b, 3)


def row(entry):
    total, active, breakdown, moe = count(entry)
    embedding = breakdown.get("embedding", 0)
    out = dict(zoo=entry["zoo"], name=entry["name"], hf_class=entry["cls"], total_params=total, active_params=active,
               published_total=int(entry["published_total"]),
               published_active=int(entry["published_active"]) if entry.get("published_active") else None,
               config=entry["cfg"], source="; ".join(entry["source"]), published_note=entry["pub_note"],
               tied_embeddings=bool(entry["cfg"].get("tie_word_embeddings")), breakdown=breakdown,
               non_embedding_params=total - embedding - breakdown.get("lm_head", 0),
               active_params_excl_input_embedding=None if active is None else active - embedding)
    if moe:
        out["moe"] = moe
    if entry.get("pub_nonemb"):
        out["published_non_embedding"] = entry["pub_nonemb"]
    out["dev_total_pct"] = pct(total, entry["published_total"])
    out["dev_active_pct"] = pct(active, entry.get("published_active"))
    out["dev_active_excl_input_embedding_pct"] = pct(out["active_params_excl_input_embedding"],
                                                      entry.get("published_active"))
    flags = []
    if abs(out["dev_total_pct"]) > 0.5:
        flags.append("total differs from published by %+.2f%%" % out["dev_total_pct"])
    if out["dev_active_pct"] is not None and abs(out["dev_active_pct"]) > 0.5:
        flags.append("active differs from published by %+.2f%% (excl. input embedding: %+.2f%%)"
                     % (out["dev_active_pct"], out["dev_active_excl_input_embedding_pct"]))
    out["flags"] = flags
    if flags:
        out["flag_explanation"] = EXPLAIN[entry["name"]]
    out["counted_with"] = f"transformers {T.__version__}, torch {torch.__version__}, meta device"
    return out


def main():
    path = HERE / "param_counts.json"
    text = path.read_text()
    rows = json.loads(text)
    added = {entry["zoo"]: row(entry) for entry in MODELS}
    rows = [r for r in rows if r.get("zoo") not in added] + list(added.values())
    path.write_text(json.dumps(rows, indent=1) + ("\n" if text.endswith("\n") else ""))
    for r in added.values():
        print(f"{r['zoo']:24} total {r['total_params']:>15,} active {r['active_params'] or '-'} {r['flags']}")


if __name__ == "__main__":
    main()
