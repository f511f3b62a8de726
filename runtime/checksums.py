"""Checksums of array trees, computed on the devices where the arrays live.

Each array's checksum is the sum, modulo 2**32, of its elements' bits (as unsigned integers)
times an odd weight taken from the element's global index. Any single flipped bit changes the
sum (2**k times an odd number is never 0 modulo 2**32), and since the weights follow the global
index, not the shards, the same values give the same checksum under any mesh or sharding: a
checkpoint written under one plan is checked when it is read under another. The sums are
elementwise products and one reduction, so XLA computes them shard by shard with one small
all-reduce; no array is gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _bits(x: jax.Array) -> jax.Array:
    """The elements' bits as uint32, with one more trailing axis of 2 for 64-bit dtypes."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    # An array kept in host memory (a plan's optimizer state) is summed in device memory; for
    # arrays already there this moves nothing.
    bits = _bits(jax.device_put(x, jax.memory.Space.Device))
    index = jnp.zeros(bits.shape, jnp.uint32)
    for axis, size in enumerate(bits.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def checksums(tree) -> dict[str, int]:
    """{key path: checksum} of every array in `tree` (a collective: every process calls it)."""
    sums = _checksums(tree)
    leaves = jax.tree_util.tree_flatten_with_path(sums)[0]
    return {jax.tree_util.keystr(path): int(np.asarray(value.addressable_data(0))) for path, value in leaves}


def mismatches(recorded: dict[str, int], tree) -> list[str]:
    """The key paths whose arrays in `tree` differ from the checksums `recorded` at save time."""
    found = checksums(tree)
    return sorted(path for path in set(recorded) | set(found) if recorded.get(path) != found.get(path))
