"""The embedding's gradient formed in pieces of the vocabulary equals take's, on one device and
on 8 virtual CPU devices with the vocabulary split over tensor (2) and the width over fsdp (4).

    python embedding_pieces.py

Run with 8 virtual CPU devices (XLA_FLAGS). Prints "embedding pieces ok"."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mxc.compiler.lower import embedding
from mxc.compiler.lower.embedding import lookup, vocab_pieces
from mxc.compiler.lower.sharding import use_rules


def main() -> None:
    table = jax.random.normal(jax.random.key(0), (48, 16))
    tokens = jnp.array([[1, 2, 2, 47], [0, -1, 7, 99]])  # a repeat, the last row, a negative and a stray id
    cotangent = jax.random.normal(jax.random.key(1), (2, 4, 16))
    reference = jax.grad(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * cotangent))(table)
    embedding.WHOLE_GRADIENT_BYTES = 48 * 16 * 4 // 5
    assert vocab_pieces((48, 16), 1) == 6 and vocab_pieces((48, 16), 2) == 3

    def grad(t, ids):
        return jax.grad(lambda t: jnp.sum(lookup(t, ids, jnp.float32) * cotangent))(t)

    np.testing.assert_array_equal(grad(table, tokens), reference)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    with use_rules(mesh, {"batch": ("fsdp",), "embed": ("fsdp",), "vocab": ("tensor",)}):
        sharded = jax.jit(grad)(table, tokens)
    assert sharded.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp"), sharded.sharding
    np.testing.assert_allclose(sharded, reference, rtol=1e-6, atol=1e-6)
    print("embedding pieces ok")


if __name__ == "__main__":
    main()
