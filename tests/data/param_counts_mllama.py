#!/usr/bin/env python3
"""Reference parameter counts for Llama 3.2 Vision 11B and 90B (MllamaForConditionalGeneration),
made as param_counts_added.py makes its rows: built on the meta device from the config values
below, every field read back unchanged, parameters summed.

Usage: .venv/bin/python tests/data/param_counts_mllama.py   (rewrites these two rows of
       param_counts.json; the other rows are kept). Run by hand, never by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as T

HERE = Path(__file__).resolve().parent

VISION = dict(hidden_size=1280, num_hidden_layers=32, num_global_layers=8, attention_heads=16,
              intermediate_size=5120, vision_output_dim=7680, image_size=560, patch_size=14, max_num_tiles=4,
              norm_eps=1e-5, intermediate_layers_indices=[3, 7, 15, 23, 30],
              supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]])
ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
TEXT_11B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False)
TEXT_90B = dict(TEXT_11B, hidden_size=8192, num_hidden_layers=100, num_attention_heads=64, intermediate_size=28672,
                cross_attention_layers=list(range(3, 100, 5)))
SOURCE = ("config values as listed, written here (no network): the 11B's are transformers' MllamaTextConfig and "
          "MllamaVisionConfig defaults but image_size 560 (both checkpoints' tile size), the 90B's text model "
          "Llama 3.1 70B's shapes in 100 layers with a cross-attention layer every fifth from 3; totals agree with "
          "Meta's model cards ({})")
MODELS = [("llama3.2-11b-vision", "Llama-3.2-11B-Vision", TEXT_11B, "11B", 10.6e9, "10.6B"),
          ("llama3.2-90b-vision", "Llama-3.2-90B-Vision", TEXT_90B, "90B", 88.6e9, "88.6B")]


def count(text: dict) -> tuple[T.MllamaConfig, dict]:
    config = T.MllamaConfig(vision_config=VISION, text_config=dict(text, rope_parameters=ROPE),
                            image_token_index=128256)
    for key, value in text.items():
        assert getattr(config.text_config, key) == value, key
    for key, value in VISION.items():
        assert getattr(config.vision_config, key) == value, key
    with torch.device("meta"):
        model = T.MllamaForConditionalGeneration(config)
    parts = {"text": 0, "vision_tower": 0, "projector": 0}
    for name, p in model.named_parameters():
        part = "vision_tower" if ".vision_model." in name else "projector" if "multi_modal_projector" in name else "text"
        parts[part] += p.numel()
    return config, parts


def main() -> None:
    path = HERE / "param_counts.json"
    rows = json.loads(path.read_text())
    names = {zoo for zoo, *_ in MODELS}
    rows = [row for row in rows if row["zoo"] not in names]
    for zoo, name, text, size, published, card in MODELS:
        _, parts = count(text)
        total = sum(parts.values())
        rows.append({"zoo": zoo, "name": name, "hf_class": "MllamaForConditionalGeneration",
                     "total_params": total, "active_params": None,
                     "vision_tower_params": parts["vision_tower"], "projector_params": parts["projector"],
                     "published_total": published,
                     "config": {"text_config": text, "vision_config": VISION, "image_token_index": 128256},
                     "source": SOURCE.format(card),
                     "counted_with": f"transformers {T.__version__}, torch {torch.__version__}, meta device"})
        print(zoo, total, parts)
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
