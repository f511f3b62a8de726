"""Every product of activations with a weight matrix in the lowering goes through here, so that
the active quantization configuration (compiler/quant/config.py; the spec's `quantize` field,
carried to the layers by LoweringChoices.quantization) applies to all of them alike.

    project(x, params, pattern, dtype, mlp=False) -> einsum(pattern, x, kernel) (+ bias)
    weight(params, dtype) -> the kernel as a float array (for stacking, slicing, grouped matmuls)
    embedded(params["embed"], tokens, dtype) -> the embedding's rows; head_params(params, tied)

`params` is a projection's dict: {"kernel", "bias"?} in float, or as compiler/quant/params.py
quantizes it ({"kernel": int8/int4/fp8 values, "kernel_scale"} or a bfloat16 kernel). Stored
quantized weights run quantized (compiler/quant/matmul.py); float weights under a configuration
that quantizes them run fake-quantized with straight-through gradients (training, and tracing
from float parameters), the same numbers. `mlp` marks the feed-forward's matrices (int4-mlp).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from mxc.compiler.lower.choices import lowering_choices, use_lowering
from mxc.compiler.lower.weight_gradients import weight_product
from mxc.compiler.quant import matmul
from mxc.compiler.quant.config import QuantConfig, parse
from mxc.compiler.quant.params import SCALE, SCALE_SUFFIX


@functools.lru_cache(maxsize=None)
def _config(name: str) -> QuantConfig:
    return parse(name)


def active_config() -> QuantConfig:
    return _config(lowering_choices().quantization)


def quantized_as_spec(fn):
    """Decorator for a function of (spec, ...): runs it under the spec's quantization."""

    @functools.wraps(fn)
    def wrapped(spec, *args, **kwargs):
        name = getattr(spec, "quantize", None) or "fp32"
        with use_lowering(dataclasses.replace(lowering_choices(), quantization=name)):
            return fn(spec, *args, **kwargs)

    return wrapped


def _applies(config: QuantConfig, mlp: bool) -> bool:
    return config.quantizes_weights and (config.scope == "all" or mlp)


def _stored_bf16(kernel, config: QuantConfig) -> bool:
    return config.weights == "bf16" and kernel.dtype == jnp.bfloat16


def head_params(params: dict, tied: bool) -> dict:
    """The output head's projection dict: the embedding table (and its scale) when tied."""
    if not tied:
        return params["head"]
    embed = params["embed"]
    head = {"kernel": embed["embedding"]}
    if "embedding" + SCALE_SUFFIX in embed:
        head[SCALE] = embed["embedding" + SCALE_SUFFIX]
    return head


def embedded(params: dict, tokens: jax.Array, dtype) -> jax.Array:
    """The embedding's rows for `tokens` in `dtype` (params: {"embedding", "embedding_scale"?}):
    stored quantized rows dequantized with their scales; float rows fake-quantized per row where
    the configuration quantizes the embedding."""
    from mxc.compiler.lower.embedding import lookup

    table = params["embedding"]
    scale = params.get("embedding" + SCALE_SUFFIX)
    if scale is not None:
        return matmul.dequantized(jnp.take(table, tokens, axis=0), jnp.take(scale, tokens, axis=0), dtype)
    rows = lookup(table, tokens, dtype)
    config = active_config()
    if _applies(config, mlp=False) and not _stored_bf16(table, config):
        rows = matmul.fake_quantized_weight(rows, (rows.ndim - 1,), config)
    return rows


def project(x: jax.Array, params: dict, pattern: str, dtype, *, mlp: bool = False, out_dtype=None) -> jax.Array:
    """`out_dtype`: the result's (the output head's float32 logits); default `dtype`."""
    config = active_config()
    kernel = params["kernel"]
    if SCALE in params:
        y = matmul.stored_einsum(pattern, x, kernel, params[SCALE], config, dtype, out_dtype)
    elif _stored_bf16(kernel, config):  # float32 arithmetic on the bfloat16 weights
        if matmul.converts_in_blocks(kernel, dtype):
            y = matmul.in_blocks(pattern, x, (kernel,), lambda x, k: jnp.einsum(
                pattern, x, k.astype(dtype), preferred_element_type=out_dtype), dtype)
        else:
            y = weight_product(pattern, x, kernel.astype(dtype), out_dtype)
    elif _applies(config, mlp):
        y = matmul.fake_quantized_einsum(pattern, x, kernel, config, dtype, out_dtype)
    else:
        y = weight_product(pattern, x, kernel.astype(dtype), out_dtype)
    if "bias" in params:
        y = y + params["bias"].astype(dtype)
    return y


def project_split(x: jax.Array, params: dict, pattern: str, dtype, sizes: tuple[int, ...], axis: int, *,
                  mlp: bool = False) -> tuple[jax.Array, ...]:
    """One product over a joined kernel (runtime/layer_layout.py: q/k/v, gate/up), its output split
    along `axis` into parts of `sizes`: each part is the product of its own kernel."""
    y = project(x, params, pattern, dtype, mlp=mlp)
    return tuple(jnp.split(y, list(itertools.accumulate(sizes[:-1])), axis=axis))


def weight(params: dict, dtype, *, mlp: bool = False, contracting: tuple[int, ...] = (0,)) -> jax.Array:
    """The kernel as `dtype`: dequantized where stored quantized, fake-quantized (scales over
    `contracting`, the axes the caller's product contracts) where the configuration asks."""
    kernel = params["kernel"]
    if SCALE in params:
        return matmul.dequantized(kernel, params[SCALE], dtype)
    config = active_config()
    if _applies(config, mlp) and not _stored_bf16(kernel, config):
        return matmul.fake_quantized_weight(kernel, contracting, config).astype(dtype)
    return kernel.astype(dtype)
