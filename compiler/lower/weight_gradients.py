"""A product of activations with a weight whose backward pass runs as canonical matrix products.

    weight_einsum(pattern, x, kernel, out_dtype=None) -> jnp.einsum(pattern, x, kernel)

The forward product is the plain einsum (over several contracted axes, a matrix product of
reshapes: `_forward_product`). Left to itself, XLA:CPU writes the backward pass's
large operand transposed so that the weight-gradient dot can read it: the logits' gradient
[tokens, vocab] and the feed-forward's gate/up gradients [tokens, hidden] are copied once more
per step (a fifth of a small Llama's train step, docs/runtime.md). Here the gradients are
products of row-major [m, k] x [k, n] matrices: the operand that has to be transposed is the
smaller one (for the weight gradient: the activations [tokens, in] or the output's gradient
[tokens, out]; for the input gradient: the weight), written out explicitly behind an
optimization barrier so that XLA cannot fold the transpose back into the dot and move it to
the large operand. Same products, summed in the same dimension: the values agree with the
plain program's to float32 rounding. The plan turns it on for CPU targets
(LoweringChoices.canonical_weight_gradients); TPU programs never take this path.

`pattern` names x's axes as batch axes (kept in the output, absent from the kernel) and
contracted axes (shared with the kernel); the kernel's other axes are output axes, e.g.
"bse,ev->bsv", "bse,ve->bsv", "bse,ehd->bshd", "bshd,hde->bse", "...i,io->...o".
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

_SPARE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _letters(pattern: str, x_rank: int) -> tuple[str, str, str] | None:
    """The pattern's (x, kernel, out) axis letters, an ellipsis spelled out for x's rank; None
    where it is not a weight product of the form the module docstring describes."""
    inputs, _, out = pattern.replace(" ", "").partition("->")
    x, _, kernel = inputs.partition(",")
    if "..." in x:
        spare = "".join(c for c in _SPARE_LETTERS if c not in pattern)
        extra = spare[:x_rank - (len(x) - 3)]
        x, out = x.replace("...", extra), out.replace("...", extra)
    if "." in kernel or len(set(x)) != len(x) or len(set(kernel)) != len(kernel):
        return None
    batch = [c for c in x if c not in kernel]
    contracted = [c for c in x if c in kernel]
    produced = [c for c in kernel if c not in x]
    if not contracted or sorted(out) != sorted(batch + produced) or any(c in out for c in contracted):
        return None
    return x, kernel, out


def _as_matrix(array, letters: str, rows: str, columns: str):
    """`array` (axes `letters`) as a [prod(rows), prod(columns)] matrix, axes in that order."""
    order = [letters.index(c) for c in rows + columns]
    moved = jnp.transpose(array, order) if order != sorted(order) else array
    return moved.reshape(math.prod(moved.shape[:len(rows)]), -1)


def _from_matrix(matrix, letters: str, rows: str, columns: str, sizes: dict):
    """The inverse of _as_matrix: back to an array with axes `letters`."""
    shaped = matrix.reshape([sizes[c] for c in rows + columns])
    order = [(rows + columns).index(c) for c in letters]
    return jnp.transpose(shaped, order) if order != sorted(order) else shaped


def _canonical_dot(a, b):
    """a [m, k] @ b [k, n], both row-major, in float32 where either is."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.result_type(a, b))


def _transposed(matrix):
    """matrix.T written out: the barrier keeps XLA from folding it back into the dot."""
    return jax.lax.optimization_barrier(jnp.transpose(matrix))


@partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _weight_einsum(pattern, x, kernel, out_dtype):
    return _forward_product(pattern, x, kernel, out_dtype)


def _forward_product(pattern, x, kernel, out_dtype):
    """The forward product. Over several contracted axes (the attention output's heads and
    head_dim, "bshd,hde->bse") it is one row-major matrix product of reshapes, x [T, I] @ kernel
    [I, O]: as an einsum, XLA:CPU contracted them in the order (head_dim, heads), against the
    kernel's, and wrote a transposed copy of the kernel at every call (one per layer per decode
    step; measured in docs/runtime.md, "Time to first token on CPUs")."""
    x_axes, kernel_axes, out_axes = _letters(pattern, x.ndim)
    contracted = "".join(c for c in x_axes if c in kernel_axes)
    if len(contracted) < 2 or not kernel_axes.startswith(contracted):
        return jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype)
    sizes = {**dict(zip(x_axes, x.shape)), **dict(zip(kernel_axes, kernel.shape))}
    batch = "".join(c for c in x_axes if c not in kernel_axes)
    produced = "".join(c for c in kernel_axes if c not in x_axes)
    rows = jax.lax.dot_general(_as_matrix(x, x_axes, batch, contracted),
                               _as_matrix(kernel, kernel_axes, contracted, produced),
                               (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)
    return _from_matrix(rows, out_axes, batch, produced, sizes)


def _forward(pattern, x, kernel, out_dtype):
    return _weight_einsum(pattern, x, kernel, out_dtype), (x, kernel)


def _backward(pattern, out_dtype, residuals, dy):
    x, kernel = residuals
    x_axes, kernel_axes, out_axes = _letters(pattern, x.ndim)
    sizes = {**dict(zip(x_axes, x.shape)), **dict(zip(kernel_axes, kernel.shape))}
    batch = "".join(c for c in x_axes if c not in kernel_axes)
    contracted = "".join(c for c in x_axes if c in kernel_axes)
    produced = "".join(c for c in kernel_axes if c not in x_axes)
    x_rows = _as_matrix(x, x_axes, batch, contracted)  # [T, I]
    dy_rows = _as_matrix(dy, out_axes, batch, produced).astype(x.dtype)  # [T, O]
    tokens, inputs = x_rows.shape
    outputs = dy_rows.shape[1]
    # The weight's gradient: transpose whichever of x and dy is smaller.
    if inputs <= outputs:
        d_kernel = _from_matrix(_canonical_dot(_transposed(x_rows), dy_rows), kernel_axes, contracted, produced, sizes)
    else:
        d_kernel = _from_matrix(_canonical_dot(_transposed(dy_rows), x_rows), kernel_axes, produced, contracted, sizes)
    # The input's gradient against the weight laid out [O, I] (a copy of the weight at most).
    kernel_out_in = jax.lax.optimization_barrier(_as_matrix(kernel.astype(x.dtype), kernel_axes, produced, contracted))
    d_x = _from_matrix(_canonical_dot(dy_rows, kernel_out_in), x_axes, batch, contracted, sizes)
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


_weight_einsum.defvjp(_forward, _backward)


def weight_einsum(pattern: str, x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    """jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype) with the backward pass
    described above; a pattern of another form is the plain einsum."""
    if _letters(pattern, x.ndim) is None:
        return jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype)
    return _weight_einsum(pattern, x, kernel, None if out_dtype is None else jnp.dtype(out_dtype))


def weight_product(pattern: str, x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    """The plan's way of multiplying by a weight: weight_einsum where it chose canonical weight
    gradients (CPU targets), else the plain einsum."""
    from mxc.compiler.lower.choices import lowering_choices
    from mxc.compiler.lower.remat import WEIGHT_PRODUCT

    if lowering_choices().canonical_weight_gradients:
        return checkpoint_name(weight_einsum(pattern, x, kernel, out_dtype), WEIGHT_PRODUCT)
    return jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype)
