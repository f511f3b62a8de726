"""Phi-3 and Phi-3.5 text models (model_type phi3, Phi3ForCausalLM).

The config reads as Llama's (config_in's `phi3` family: no biases, an optional sliding window on
every layer, LongRoPE scaling). The checkpoint differs in two fused tensors per layer:
self_attn.qkv_proj.weight holds the q, k and v projections stacked on the output axis
([(heads + 2 · kv_heads) · head_dim, embed], q first), and mlp.gate_up_proj.weight the gate and
up projections ([2 · hidden, embed], gate first, as the model's `chunk(2)` reads it). Import
splits them into mxc's separate kernels and export concatenates them again, so the round trip is
exact.

A spec is Phi-3's when a layer uses LongRoPE; a Phi-3 checkpoint without it (the 4k models) is
found by its config's model_type (mapping.tensor_maps).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from mxc.compiler.hf.config_in import dense_spec_from_config
from mxc.compiler.hf.config_out import dense_config
from mxc.compiler.hf.families import FamilyConverter
from mxc.compiler.hf.mapping import (FusedTensorMap, LayoutError, _heads_in, _heads_out, _transpose,
                                     layer_entry, norm_maps, top_level_maps)
from mxc.compiler.lower.params import layer_slots
from mxc.spec.ir import GLU, MLA, LongRopeScaling, ModelSpec

ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
PHI3_TOKEN_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000}  # Phi3Config's


def spec_from_config(cfg: dict, name: str, param_dtype: str | None = None) -> ModelSpec:
    return dense_spec_from_config(cfg, "phi3", name, param_dtype)


def describes(spec: ModelSpec) -> bool:
    return any(b.attention.rope is not None and isinstance(b.attention.rope.scaling, LongRopeScaling)
               for b in spec.blocks.values())


def config_from_spec(spec: ModelSpec) -> dict:
    cfg = dense_config(spec, "phi3")
    scaling = spec.blocks[spec.layer_kinds[0]].attention.rope.scaling
    if isinstance(scaling, LongRopeScaling):
        cfg["original_max_position_embeddings"] = scaling.original_max_seq  # Phi3Config's own field too
    for key, default in PHI3_TOKEN_DEFAULTS.items():
        if default >= spec.vocab:  # Phi3Config's default ids would point past a smaller vocabulary
            cfg[key] = None
    return cfg


def _split_rows(sizes: tuple[int, ...], converts: tuple):
    """HF [sum(sizes), in] -> each part through its own to_mxc."""
    def to_mxc(fused: np.ndarray) -> tuple[np.ndarray, ...]:
        ends = np.cumsum(sizes)[:-1]
        return tuple(convert(part) for convert, part in zip(converts, np.split(fused, ends, axis=0)))
    return to_mxc


def _join_rows(converts: tuple):
    def to_hf(parts: tuple[np.ndarray, ...]) -> np.ndarray:
        return np.concatenate([convert(part) for convert, part in zip(converts, parts)], axis=0)
    return to_hf


def tensor_maps(spec: ModelSpec) -> Iterator:
    yield from top_level_maps(spec)
    for slot in layer_slots(spec):
        block = spec.blocks[slot.block]
        att, ffn = block.attention, block.mlp
        if (isinstance(att, MLA) or not isinstance(ffn, GLU) or ffn.bias or att.qkv_bias or att.out_bias
                or att.qk_norm is not None or att.sinks or att.chunk is not None
                or att.temperature_tuning is not None or block.post_norm is not None):
            raise LayoutError(f"block '{slot.block}': a Phi-3 layer is bias-free attention (no QK-norm) with "
                              "a bias-free glu feed-forward")
        entry = layer_entry(slot)
        yield from norm_maps(entry, block, slot.block)
        heads = (att.heads, att.kv_heads, att.kv_heads)
        in_convert = tuple(_heads_in(h, att.head_dim) for h in heads)
        yield FusedTensorMap(entry.hf_prefix + "self_attn.qkv_proj.weight",
                             tuple(entry.base + ("attention", proj, "kernel") for proj in ("q", "k", "v")),
                             entry.repeat, _split_rows(tuple(h * att.head_dim for h in heads),
                                                       tuple(c[0] for c in in_convert)),
                             _join_rows(tuple(c[1] for c in in_convert)))
        yield entry("self_attn.o_proj.weight", ("attention", "o", "kernel"), _heads_out(att.heads, att.head_dim))
        yield FusedTensorMap(entry.hf_prefix + "mlp.gate_up_proj.weight",
                             (entry.base + ("mlp", "gate", "kernel"), entry.base + ("mlp", "up", "kernel")),
                             entry.repeat, _split_rows((ffn.hidden, ffn.hidden), (_transpose, _transpose)),
                             _join_rows((_transpose, _transpose)))
        yield entry("mlp.down_proj.weight", ("mlp", "down", "kernel"), (_transpose, _transpose))


CONVERTER = FamilyConverter(model_types=("phi3",), architectures=ARCHITECTURES,
                            spec_from_config=spec_from_config, config_from_spec=config_from_spec,
                            describes=describes, tensor_maps=tensor_maps)
