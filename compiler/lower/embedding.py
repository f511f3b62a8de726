"""Token embedding lookup that stays local to each device's own tokens under FSDP.

The table's embed axis is sharded over the same devices that split the batch. Left to itself,
XLA gathers every device's token ids (the global batch), looks all of them up in its slice of
the table, and in the backward pass scatter-adds the whole global batch into that slice, sorting
all of its ids: at 2048 x 4096 tokens an 8M-key sort on every step, and one of the costliest
kernels to compile. Here the table is gathered first, in the compute dtype, as every
layer's weight is, so each device looks up only its own tokens; the gradient is scatter-added in
float32 (a token seen many times in a batch must not be summed in bf16) into a full-size table
and reduced to the table's sharding.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mxc.compiler.lower.sharding import constrain

TABLE_AXES = ("vocab", "embed")
GATHERED_AXES = ("vocab", None)  # the embed axis whole on every device


def lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table [vocab, embed], tokens [...] int -> [..., embed] in dtype."""
    return _lookup(jnp.dtype(dtype), table, tokens)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(dtype, table, tokens):
    gathered = constrain(table.astype(dtype), GATHERED_AXES)
    return jnp.take(gathered, tokens, axis=0)


def _lookup_forward(dtype, table, tokens):
    return _lookup(dtype, table, tokens), (table, tokens)


def _lookup_backward(dtype, residuals, cotangent):
    table, tokens = residuals
    # take's own transpose (a scatter-add that drops out-of-range ids, which read zeros) into a
    # float32 table held whole on each device, then reduced to the table's sharding.
    whole = constrain(jnp.zeros(table.shape, jnp.float32), GATHERED_AXES)
    _, transpose = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), whole)
    (grad,) = transpose(cotangent.astype(jnp.float32))
    return constrain(constrain(grad, GATHERED_AXES), TABLE_AXES).astype(table.dtype), None


_lookup.defvjp(_lookup_forward, _lookup_backward)
