"""Quantization configurations by name: what is quantized, to which type, with which granularity.

Plain Python (no JAX): the spec's `quantize` field and the CLI validate names with it.

    fp32            no quantization
    bf16            projection weights stored bfloat16, arithmetic in the compute dtype
    int8            weights int8, one scale per output channel
    w8a8            int8 weights per output channel and int8 activations per token
    int4            weights int4, one scale per group of 128 inputs of each output channel
    int4-mlp        int4 as above for the feed-forward (MLP and experts) matrices only
    fp8             weights and activations float8 e4m3 (per output channel / per token);
                    gradients rounded to e5m2 in training
    int8-kv         the KV cache stored int8, one scale per token and head

`+` combines a weight configuration with the KV cache's: `int8+int8-kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = 128  # int4's group along the input dimension (shorter where the dimension is not a multiple)


class QuantizationError(ValueError):
    """A configuration name that does not parse."""


@dataclass(frozen=True)
class QuantConfig:
    name: str
    weights: str | None = None  # "int8", "int4", "fp8", "bf16" or None
    activations: str | None = None  # "int8", "fp8" or None
    scope: str = "all"  # "all" projections, or "mlp" only
    group_size: int | None = None  # None: one scale per output channel
    kv_cache: str | None = None  # "int8" or None
    gradients: str | None = None  # "e5m2" where training rounds the gradients of the matmul inputs

    @property
    def quantizes_weights(self) -> bool:
        return self.weights is not None


_WEIGHT_CONFIGS = {
    "fp32": {},
    "bf16": {"weights": "bf16"},
    "int8": {"weights": "int8"},
    "w8a8": {"weights": "int8", "activations": "int8"},
    "int4": {"weights": "int4", "group_size": GROUP_SIZE},
    "int4-mlp": {"weights": "int4", "group_size": GROUP_SIZE, "scope": "mlp"},
    "fp8": {"weights": "fp8", "activations": "fp8", "gradients": "e5m2"},
}
_KV_CONFIGS = {"int8-kv": {"kv_cache": "int8"}}
NAMES = tuple(_WEIGHT_CONFIGS) + tuple(_KV_CONFIGS)


def parse(name: str) -> QuantConfig:
    """The configuration `name` names (e.g. "int8", "int8+int8-kv"); QuantizationError otherwise."""
    parts = [part.strip() for part in str(name).split("+")]
    if not all(parts):
        raise QuantizationError(f"quantization '{name}' has an empty part; write e.g. int8+int8-kv")
    unknown = [part for part in parts if part not in NAMES]
    if unknown:
        raise QuantizationError(f"unknown quantization '{unknown[0]}'; choose from {', '.join(NAMES)} "
                                "(a weight configuration may be combined with int8-kv by '+')")
    weights = [part for part in parts if part in _WEIGHT_CONFIGS]
    caches = [part for part in parts if part in _KV_CONFIGS]
    if len(weights) > 1 or len(caches) > 1:
        raise QuantizationError(f"quantization '{name}' names two configurations of the same thing; "
                                "combine at most one weight configuration with int8-kv")
    fields = {**(_WEIGHT_CONFIGS[weights[0]] if weights else {}), **(_KV_CONFIGS[caches[0]] if caches else {})}
    return QuantConfig(name="+".join(weights + caches), **fields)


FLOAT = parse("fp32")
