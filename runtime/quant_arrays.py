"""Symmetric absmax quantization of arrays, pure jax.numpy: shared by the compiler (mxc quantize,
the quantized lowering) and the runtime, which quantizes a float checkpoint at load for a
quantized artifact without the compiler.

A quantized array is (values, scale) with the scale of the same rank as the values: each scale
axis is either 1 (one scale over the whole axis: the contracting axes), the axis' own length
(one scale per entry: the output channels) or a divisor of it (one scale per group of
length/scale entries: int4's groups along the input). values ≈ original / scale, so
original ≈ values * scale broadcast by repeating each scale over its group (qwix's QArray
layout; tests compare with qwix.qarray).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The largest magnitude each stored type holds, and the bound absmax maps to: integers use the
# whole top bucket (qmax + 0.5, as qwix), floats their finite maximum.
STORAGE = {
    "int8": (jnp.int8, 127.5),
    "int4": (jnp.int4, 7.5),
    "fp8": (jnp.float8_e4m3fn, float(jnp.finfo(jnp.float8_e4m3fn).max)),
}


def storage_dtype(kind: str):
    return STORAGE[kind][0]


def kind_of_dtype(dtype) -> str:
    """The STORAGE key of a stored dtype."""
    for kind, (stored, _) in STORAGE.items():
        if jnp.dtype(stored) == jnp.dtype(dtype):
            return kind
    raise ValueError(f"{dtype} is not a quantized storage type (int8, int4, float8_e4m3fn)")


def _grouped(x: jax.Array, scale_shape: tuple[int, ...]) -> jax.Array:
    """x reshaped so that every axis whose scale is grouped becomes (groups, group): axis i of
    length n with s scales becomes (s, n // s)."""
    shape = []
    for n, s in zip(x.shape, scale_shape):
        if n % s:
            raise ValueError(f"scale shape {tuple(scale_shape)} does not divide {tuple(x.shape)}")
        shape += [s, n // s]
    return x.reshape(shape)


def scales(x: jax.Array, kind: str, scale_shape: tuple[int, ...]) -> jax.Array:
    """float32 scales of shape `scale_shape`: each group's absmax over the bound of `kind`."""
    grouped = _grouped(jnp.abs(x.astype(jnp.float32)), scale_shape)
    absmax = jnp.max(grouped, axis=tuple(range(1, grouped.ndim, 2)))
    scale = absmax / STORAGE[kind][1]
    # An all-zero group keeps scale 1 (its values are 0 either way) rather than dividing by 0.
    return jnp.where(scale > 0, scale, jnp.ones_like(scale))


def broadcast_scale(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Each scale repeated over its group, to `shape`."""
    for axis, (n, s) in enumerate(zip(shape, scale.shape)):
        if s not in (1, n):
            scale = jnp.repeat(scale, n // s, axis=axis)
    return jnp.broadcast_to(scale, shape)


def quantize_with(x: jax.Array, kind: str, scale: jax.Array) -> jax.Array:
    """x / scale rounded (integers) or cast (fp8) into the storage type, saturating."""
    stored, bound = STORAGE[kind]
    y = x.astype(jnp.float32) / broadcast_scale(scale, x.shape)
    if kind == "fp8":
        return jnp.clip(y, -bound, bound).astype(stored)
    limit = jnp.iinfo(stored).max  # symmetric: the group's absmax lands on ±limit however it rounds
    return jnp.clip(jnp.round(y), -limit, limit).astype(stored)


def quantize(x: jax.Array, kind: str, scale_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(values, float32 scale) of x."""
    scale = scales(x, kind, tuple(scale_shape))
    return quantize_with(x, kind, scale), scale


def dequantize(values: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (values.astype(jnp.float32) * broadcast_scale(scale, values.shape)).astype(dtype)


def scale_shape(shape: tuple[int, ...], contracting: tuple[int, ...], group_size: int | None) -> tuple[int, ...]:
    """The scale shape of a weight: 1 along its contracting axes (per output channel), or with
    group_size one scale per group along the last contracting axis (groups of the largest divisor
    of its length not above group_size, so every group has the same length)."""
    out = [1 if axis in contracting else n for axis, n in enumerate(shape)]
    if group_size is not None and contracting:
        # Groups run along the last contracting axis only; the others (attention's heads before
        # head_dim) keep one scale per entry, so no group spans two of them.
        for other in contracting:
            out[other] = shape[other]
        axis = max(contracting)
        length = shape[axis]
        group = max(g for g in range(1, min(group_size, length) + 1) if length % g == 0)
        out[axis] = length // group
    return tuple(out)
