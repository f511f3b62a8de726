"""Token embedding lookup that stays local to each device's own tokens under FSDP.

The table's embed axis is sharded over the same devices that split the batch. Left to itself,
XLA gathers every device's token ids (the global batch), looks all of them up in its slice of
the table, and in the backward pass scatter-adds the whole global batch into that slice, sorting
all of its ids: at 2048 x 4096 tokens an 8M-key sort on every step, and one of the costliest
kernels to compile. Here the table is gathered first, in the compute dtype, as every
layer's weight is, so each device looks up only its own tokens; the gradient is scatter-added in
float32 (a token seen many times in a batch must not be summed in bf16) into a full-size table
and reduced to the table's sharding. Where that table would be large (XLA holds it twice, before
and after its all-reduce), it is formed a piece of the vocabulary at a time, each piece reduced
before the next is formed.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mxc.compiler.lower.sharding import constrain, pieces

TABLE_AXES = ("vocab", "embed")
GATHERED_AXES = ("vocab", None)  # the embed axis whole on every device
# The most bytes of the float32 gradient held whole on a device at once (docs/plans.md, "The
# embedding's gradient").
WHOLE_GRADIENT_BYTES = 1 << 30


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
    cotangent = cotangent.astype(jnp.float32)
    shards = pieces(GATHERED_AXES, 0)  # the vocabulary's split over the mesh
    count = vocab_pieces(table.shape, shards)
    if count == 1:
        # take's own transpose (a scatter-add that drops out-of-range ids, which read zeros) into
        # a float32 table held whole on each device, then reduced to the table's sharding.
        whole = constrain(jnp.zeros(table.shape, jnp.float32), GATHERED_AXES)
        _, transpose = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), whole)
        (grad,) = transpose(cotangent)
        return constrain(constrain(grad, GATHERED_AXES), TABLE_AXES).astype(table.dtype), None
    vocab, width = table.shape
    local = vocab // shards  # each vocabulary shard's rows
    rows = local // count  # of them in one piece
    ids = jnp.where(tokens < 0, tokens + vocab, tokens)  # take reads a negative id from the end
    inside = (ids >= 0) & (ids < vocab)
    shard, offset = ids // local, ids % local

    def piece(_, index):
        # Piece `index` holds rows [index * rows, (index + 1) * rows) of every shard, so that it
        # splits over the shards as the table does; other ids fall outside it and are dropped.
        mine = inside & (offset // rows == index)
        at = jnp.where(mine, shard * rows + offset % rows, shards * rows)
        whole = constrain(jnp.zeros((shards * rows, width), jnp.float32), GATHERED_AXES)
        grad = whole.at[at].add(cotangent, mode="drop")
        return None, constrain(constrain(grad, GATHERED_AXES), TABLE_AXES)

    _, grads = jax.lax.scan(piece, None, jnp.arange(count))  # [count, shards * rows, width]
    grads = grads.reshape(count, shards, rows, width).swapaxes(0, 1).reshape(vocab, width)
    return constrain(grads, TABLE_AXES).astype(table.dtype), None


def vocab_pieces(shape: tuple[int, int], shards: int) -> int:
    """How many pieces the gradient of a [vocab, width] table split `shards` ways over its
    vocabulary is formed in: the fewest that divide each shard's rows and keep a piece within
    WHOLE_GRADIENT_BYTES (all the rows at once where none does)."""
    vocab, width = shape
    if vocab % shards:
        return 1
    local = vocab // shards
    needed = -(-local * width * 4 // WHOLE_GRADIENT_BYTES)
    if needed == 1:
        return 1
    # A piece of at least 8 rows: one float32 tile's height on a TPU, so no piece is mostly padding.
    return next((n for n in range(needed, local + 1) if local % n == 0 and local // n >= 8), 1)


_lookup.defvjp(_lookup_forward, _lookup_backward)
