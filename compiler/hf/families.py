"""HF families whose layout is not Llama's, one module each, found by model_type or by spec.

Each module exposes a `CONVERTER`; config_in, config_out and mapping ask here first and fall
back to the Llama-family code (Llama, Mistral, Qwen3, Gemma 1/2/3) when no converter claims the
config or the spec. Modules are imported on first use, so that they may import config_in and
mapping themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterator

from mxc.spec.ir import ModelSpec

# Asked in this order: the first whose `describes` accepts a spec converts it.
FAMILY_MODULES = ("mxc.compiler.hf.llama4", "mxc.compiler.hf.llama4_vision", "mxc.compiler.hf.gpt_oss",
                  "mxc.compiler.hf.mixtral", "mxc.compiler.hf.deepseek", "mxc.compiler.hf.phi3",
                  "mxc.compiler.hf.gemma3_vision", "mxc.compiler.hf.mllama")


@dataclass(frozen=True)
class FamilyConverter:
    model_types: tuple[str, ...]  # config.json's model_type values this module reads
    architectures: dict[str, str]  # model_type -> the transformers class config.json names
    spec_from_config: Callable[[dict, str, str | None], ModelSpec]  # (cfg, name, param_dtype)
    config_from_spec: Callable[[ModelSpec], dict]
    describes: Callable[[ModelSpec], bool]  # whether a spec is of this family
    tensor_maps: Callable[[ModelSpec], Iterator]  # TensorMap / FusedTensorMap, as mapping.tensor_maps
    # (cfg, the checkpoint's tensor names) -> the config those tensors realise, where a family's
    # checkpoints may lack parts their config names (DeepSeek's MTP layers); None: cfg as it is.
    checkpoint_config: Callable[[dict, frozenset[str]], dict] | None = None
    # The checkpoint's tensor names -> {name: the name tensor_maps uses} for those spelt another
    # way (Gemma 3's vision checkpoints); None: the maps' names are the only spelling.
    canonical_names: Callable[..., dict[str, str]] | None = None


def converters() -> list[FamilyConverter]:
    return [importlib.import_module(name).CONVERTER for name in FAMILY_MODULES]


def converter_for_model_type(model_type: str | None) -> FamilyConverter | None:
    return next((c for c in converters() if model_type in c.model_types), None)


def converter_for_spec(spec: ModelSpec) -> FamilyConverter | None:
    return next((c for c in converters() if c.describes(spec)), None)


def config_for_checkpoint(cfg: dict, tensor_names) -> dict:
    """The config to read a spec from, given the tensor names the checkpoint holds."""
    converter = converter_for_model_type(cfg.get("model_type"))
    if converter is None or converter.checkpoint_config is None:
        return cfg
    return converter.checkpoint_config(cfg, frozenset(tensor_names))


def renamed(names, spec: ModelSpec) -> dict[str, str]:
    """{checkpoint name: the tensor maps' name} for the names the spec's family spells another way."""
    converter = converter_for_spec(spec)
    if converter is None or converter.canonical_names is None:
        return {}
    return converter.canonical_names(names)


def model_types() -> list[str]:
    return [t for c in converters() for t in c.model_types]


def block_names(blocks: list, labels: list[str]) -> list[str]:
    """One name per layer: `block` when every layer is the same, else the layer's label (a word
    for what distinguishes it, e.g. `sliding_moe`), numbered when one label covers several
    distinct blocks."""
    distinct = list(dict.fromkeys(blocks))
    if len(distinct) == 1:
        return ["block"] * len(blocks)
    names: list[str] = []
    for block in distinct:
        base = labels[blocks.index(block)]
        taken = sum(1 for n in names if n == base or n.startswith(base + "_") and n[len(base) + 1:].isdigit())
        names.append(base if taken == 0 else f"{base}_{taken + 1}")
    return [names[distinct.index(block)] for block in blocks]


def attention_class(heads: int, kv_heads: int):
    """MHA, MQA or GQA by the key/value head count (the IR's kinds, as config_in picks them)."""
    from mxc.spec.ir import GQA, MHA, MQA

    if kv_heads == heads:
        return lambda **fields: MHA(**fields)
    if kv_heads == 1:
        return lambda **fields: MQA(**fields)
    return lambda **fields: GQA(kv_heads=kv_heads, **fields)
