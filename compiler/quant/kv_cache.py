"""The int8 KV cache (`int8-kv`): keys and values stored int8 with one float32 scale per token
and head (over head_dim), written quantized and read dequantized by attention.

A cache entry "k" [.., cache_seq, kv_heads, head_dim] gets a companion "k_scale"
[.., cache_seq, kv_heads, 1]; whether a cache is quantized is read off the cache itself (the
scale entries), so attention needs no configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.param_def import UnsupportedError
from mxc.compiler.lower.sharding import constrain
from mxc.compiler.quant.config import parse
from mxc.runtime import quant_arrays

QUANTIZED = ("k", "v")
_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


def _int8(spec) -> bool:
    return spec is not None and parse(getattr(spec, "quantize", None) or "fp32").kv_cache == "int8"


def with_scales(entries: dict, spec) -> dict:
    """A layer's cache entries {name: (shape, axes)}, with a scale entry beside each quantized
    one when the spec's configuration stores the cache int8."""
    if not _int8(spec):
        return entries
    if not set(QUANTIZED) <= set(entries):
        raise UnsupportedError(f"the int8 KV cache stores keys and values; this layer caches "
                               f"{', '.join(entries)} (MLA's latent cache stays in the compute dtype)")
    out = dict(entries)
    for name in QUANTIZED:
        shape, axes = entries[name]
        out[name + "_scale"] = ((*shape[:-1], 1), (*axes[:-1], None))
    return out


def entry_dtype(name: str, dtype, spec):
    """The dtype of cache entry `name` (dtype: the float cache's)."""
    if not _int8(spec):
        return dtype
    if name in QUANTIZED:
        return jnp.int8
    return jnp.float32 if name.endswith("_scale") else dtype


def written(cache: dict, new: dict, index) -> dict:
    """The layer's cache with `new` {"k", "v"} [batch, seq, kv_heads, head_dim] written at slot
    `index` (quantized per token and head where the cache is int8)."""
    out = dict(cache)
    for name, value in new.items():
        start = (0, index) + (0,) * (value.ndim - 2)
        if name + "_scale" in cache:
            value, scale = quant_arrays.quantize(value, "int8", (*value.shape[:-1], 1))
            out[name + "_scale"] = constrain(jax.lax.dynamic_update_slice(cache[name + "_scale"], scale, start),
                                             _AXES[:-1] + (None,))
        out[name] = constrain(jax.lax.dynamic_update_slice(cache[name], value.astype(cache[name].dtype), start), _AXES)
    return out


def read(cache: dict, name: str, dtype) -> jax.Array:
    if name + "_scale" in cache:
        return quant_arrays.dequantize(cache[name], cache[name + "_scale"], dtype)
    return cache[name].astype(dtype)
