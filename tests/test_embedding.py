"""The embedding lookup: the same values and gradients as jnp.take, and under FSDP each device
looks up only its own tokens (no gather of the global batch's ids, no sort of them)."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from mxc.compiler.lower.embedding import lookup


def test_values_and_gradient_equal_take():
    table = jax.random.normal(jax.random.key(0), (50, 16))
    tokens = jnp.array([[1, 2, 2, 49], [0, 2, 7, 7]])
    cotangent = jax.random.normal(jax.random.key(1), (2, 4, 16))
    np.testing.assert_array_equal(lookup(table, tokens, jnp.float32), jnp.take(table, tokens, axis=0))
    # Repeated ids sum their rows' gradients; an out-of-range id (99) gets none, as with take.
    with_stray = tokens.at[1, 0].set(99)
    ours = jax.grad(lambda t: jnp.sum(lookup(t, with_stray, jnp.float32) * cotangent))(table)
    reference = jax.grad(lambda t: jnp.sum(jnp.take(t, with_stray, axis=0) * cotangent))(table)
    np.testing.assert_array_equal(ours, reference)
    # bf16 rows for bf16 compute; the gradient stays float32.
    assert lookup(table, tokens, jnp.bfloat16).dtype == jnp.bfloat16
    low = jax.grad(lambda t: jnp.sum(lookup(t, tokens, jnp.bfloat16).astype(jnp.float32) * cotangent))(table)
    assert low.dtype == jnp.float32


def test_fsdp_lookup_stays_with_each_devices_tokens():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.topology import device_mesh, devices, parse

    topology = parse("v5p-16")  # 8 chips, with SparseCores
    found = devices(topology)
    mesh = device_mesh(topology, ("fsdp",), (len(found),), found=found)
    rules = {"batch": ("fsdp",), "embed": ("fsdp",)}
    table = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    tokens = jax.ShapeDtypeStruct((64, 512), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None)))

    def loss(t, ids):
        return jnp.sum(lookup(t, ids, jnp.bfloat16).astype(jnp.float32) ** 2)

    with use_rules(mesh, rules):
        text = jax.jit(jax.grad(loss)).lower(table, tokens).compile().as_text()
    gathered_ids = [line for line in text.splitlines() if re.search(r"= s32\[[^\]]*\]\S* all-gather\(", line)]
    assert not gathered_ids, gathered_ids[:2]
    assert " sort(" not in text and "sort" not in re.findall(r"custom_call_target=\"(\w+)\"", text)
