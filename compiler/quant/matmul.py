"""The quantized matmuls behind compiler/lower/projection.py.

Stored weights (values and a scale per output channel) multiply as they are stored: the values are
converted inside the product and the scale applied to its float32 result, so the weights are read
once at their stored width (decode reads every weight once a step and is bandwidth bound).
int4's group-wise scales vary along the contracting axis, so those weights are dequantized first.
XLA:CPU does not fuse a conversion into its dot: it writes the whole converted weight to a new
temporary first, which for a large weight (SmolLM2's tied 49152x576 head: 113 MB a decode step)
costs ten times the product. Where the lowering chooses it (CPU targets), a weight above
BLOCKED_ABOVE is therefore converted and multiplied in blocks of its output axis that stay in
cache (in_blocks); layers' weights inside the layer scan are small and converted as sliced.
w8a8 quantizes the activations per token and multiplies int8 by int8 into int32; fp8 rounds the
activations to e4m3 per token (scaled) and multiplies in the compute dtype, which is what XLA runs
on chips without fp8 units too.

Float weights under a configuration (quantization-aware training) are fake-quantized: the forward
pass sees exactly the stored numbers, the backward pass passes the gradient straight through
(as qwix's QAT); fp8 also rounds the gradient flowing into the activations to e5m2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.quant.config import QuantConfig
from mxc.runtime import quant_arrays


def _parse(pattern: str) -> tuple[str, str, str]:
    inputs, out = pattern.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    if "..." in w_sub:
        raise ValueError(f"projection pattern {pattern}: the kernel's axes must be named")
    return x_sub, w_sub, out


def _contracted(sub: str, out: str, ndim: int) -> tuple[int, ...]:
    """Axes of an operand with subscripts `sub` (maybe led by '...') that `out` does not keep."""
    letters = sub.replace("...", "")
    offset = ndim - len(letters)
    return tuple(offset + i for i, letter in enumerate(letters) if letter not in out)


def _to_output(array: jax.Array, sub: str, out: str, out_ndim: int) -> jax.Array:
    """`array` (subscripts `sub`, every letter kept by `out`) transposed and given unit axes so it
    broadcasts against the product's result (subscripts `out`, out_ndim axes)."""
    letters = sub.replace("...", "")
    out_letters = out.replace("...", "")
    ellipsis = array.ndim - len(letters)
    order = sorted(range(len(letters)), key=lambda i: out_letters.index(letters[i]))
    array = array.transpose(tuple(range(ellipsis)) + tuple(ellipsis + i for i in order))
    sizes = {letter: array.shape[ellipsis + k] for k, letter in enumerate(letters[i] for i in order)}
    shape = ((1,) * (out_ndim - len(out_letters) - ellipsis) + array.shape[:ellipsis]
             + tuple(sizes.get(letter, 1) for letter in out_letters))
    return array.reshape(shape)


BLOCKED_ABOVE = 32 << 20  # bytes of a converted weight beyond which CPU targets convert it in blocks
BLOCK_BYTES = 4 << 20  # bytes of one converted block: within a CPU's last-level cache


def converts_in_blocks(values: jax.Array, dtype) -> bool:
    """Whether the product with stored weight `values` (to be converted to `dtype`) runs in_blocks."""
    from mxc.compiler.lower.choices import lowering_choices

    converted = values.size * jnp.dtype(dtype).itemsize
    return (lowering_choices().blocked_weight_conversion and jnp.dtype(values.dtype) != jnp.dtype(dtype)
            and converted > BLOCKED_ABOVE)


def in_blocks(pattern: str, x: jax.Array, weights: tuple, product, dtype) -> jax.Array:
    """product(x, *weights) computed over blocks of the weights' first output axis (an axis `out`
    keeps that x lacks), one block at a time in a loop, so that each block's converted copy stays
    in cache. `weights` share that axis (a scale has the weight's length or 1 on it)."""
    x_sub, w_sub, out = _parse(pattern)
    letters = w_sub
    axis = next((i for i, c in enumerate(letters) if c in out and c not in x_sub), None)
    if axis is None:
        return product(x, *weights)
    n = weights[0].shape[axis]
    row_bytes = weights[0].size // n * jnp.dtype(dtype).itemsize
    block = max((b for b in range(1, n + 1) if n % b == 0 and b * row_bytes <= BLOCK_BYTES), default=1)
    if block == n:
        return product(x, *weights)

    def split(w):
        if w.shape[axis] == 1:
            return None
        return jnp.moveaxis(w, axis, 0).reshape(n // block, block, *w.shape[:axis], *w.shape[axis + 1:])

    split_weights = [split(w) for w in weights]
    stacked = [w for w in split_weights if w is not None]

    def one_block(blocks):
        blocks = iter(blocks)
        parts = [w if s is None else jnp.moveaxis(next(blocks), 0, axis) for w, s in zip(weights, split_weights)]
        return product(x, *parts)

    ys = jax.lax.map(one_block, stacked)  # [blocks, *out with the axis at `block`]
    out_letters = out.replace("...", "")
    position = ys.ndim - 1 - (len(out_letters) - out_letters.index(letters[axis]))
    ys = jnp.moveaxis(ys, 0, position)
    return ys.reshape(*ys.shape[:position], n, *ys.shape[position + 2:])


def _drop(sub: str, out: str) -> str:
    return "".join(c for c in sub if c in out or c == ".")


def dequantized(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return quant_arrays.dequantize(values, scale, dtype)


def _per_channel(scale: jax.Array, contracting: tuple[int, ...]) -> bool:
    return all(scale.shape[axis] == 1 for axis in contracting)


def _token_quantized(x: jax.Array, kind: str, contracting: tuple[int, ...]):
    shape = tuple(1 if axis in contracting else n for axis, n in enumerate(x.shape))
    return quant_arrays.quantize(x, kind, shape)


def stored_einsum(pattern: str, x: jax.Array, values: jax.Array, scale: jax.Array, config: QuantConfig,
                  dtype, out_dtype=None) -> jax.Array:
    if converts_in_blocks(values, dtype):
        return in_blocks(pattern, x, (values, scale),
                         lambda x, v, s: _stored_einsum(pattern, x, v, s, config, dtype, out_dtype), dtype)
    return _stored_einsum(pattern, x, values, scale, config, dtype, out_dtype)


def _stored_einsum(pattern: str, x: jax.Array, values: jax.Array, scale: jax.Array, config: QuantConfig,
                   dtype, out_dtype=None) -> jax.Array:
    out_dtype = out_dtype or dtype
    x_sub, w_sub, out = _parse(pattern)
    w_contracting = _contracted(w_sub, out, values.ndim)
    x_contracting = _contracted(x_sub, out, x.ndim)
    if config.activations == "fp8":
        x = _fake_quantized(x, "fp8", x_contracting)
    if not _per_channel(scale, w_contracting):  # int4's groups
        return jnp.einsum(pattern, x, dequantized(values, scale, dtype),
                          preferred_element_type=jnp.float32).astype(out_dtype)
    if config.activations == "int8":
        xq, x_scale = _token_quantized(x, "int8", x_contracting)
        y = jnp.einsum(pattern, xq, values, preferred_element_type=jnp.int32).astype(jnp.float32)
        x_scale = jnp.squeeze(x_scale, x_contracting)
        y = y * _to_output(x_scale, _drop(x_sub, out), out, y.ndim)
    else:
        y = jnp.einsum(pattern, x, values.astype(dtype), preferred_element_type=jnp.float32)
    w_scale = jnp.squeeze(scale, w_contracting)
    return (y * _to_output(w_scale, _drop(w_sub, out), out, y.ndim)).astype(out_dtype)


def _straight_through(x: jax.Array, rounded: jax.Array) -> jax.Array:
    """`rounded` forward, the identity's gradient backward."""
    return x + jax.lax.stop_gradient(rounded - x)


def _fake_quantized(x: jax.Array, kind: str, contracting: tuple[int, ...]) -> jax.Array:
    values, scale = _token_quantized(jax.lax.stop_gradient(x), kind, contracting)
    return _straight_through(x, quant_arrays.dequantize(values, scale, x.dtype))


def fake_quantized_weight(kernel: jax.Array, contracting: tuple[int, ...], config: QuantConfig) -> jax.Array:
    if config.weights == "bf16":
        return _straight_through(kernel, kernel.astype(jnp.bfloat16).astype(kernel.dtype))
    shape = quant_arrays.scale_shape(kernel.shape, contracting, config.group_size)
    values, scale = quant_arrays.quantize(jax.lax.stop_gradient(kernel), config.weights, shape)
    return _straight_through(kernel, quant_arrays.dequantize(values, scale, kernel.dtype))


@jax.custom_vjp
def _e5m2_gradient(x):
    return x


def _e5m2_forward(x):
    return x, None


def _e5m2_backward(_, g):
    # Scaled per tensor, as fp8 training does: unscaled, small gradients would flush to zero.
    bound = float(jnp.finfo(jnp.float8_e5m2).max)
    amax = jnp.max(jnp.abs(g)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / bound, 1.0)
    return (((g / scale).astype(jnp.float8_e5m2).astype(jnp.float32) * scale).astype(g.dtype),)


_e5m2_gradient.defvjp(_e5m2_forward, _e5m2_backward)


def fake_quantized_einsum(pattern: str, x: jax.Array, kernel: jax.Array, config: QuantConfig, dtype,
                          out_dtype=None) -> jax.Array:
    x_sub, w_sub, out = _parse(pattern)
    w = fake_quantized_weight(kernel, _contracted(w_sub, out, kernel.ndim), config)
    if config.activations is not None:
        x = _fake_quantized(x, config.activations, _contracted(x_sub, out, x.ndim))
    if config.gradients == "e5m2":
        x = _e5m2_gradient(x)
    return jnp.einsum(pattern, x, w.astype(dtype), preferred_element_type=out_dtype)
