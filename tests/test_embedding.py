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


def test_gradient_in_pieces_equals_take():
    """A table whose float32 gradient exceeds WHOLE_GRADIENT_BYTES gets it a piece of the
    vocabulary at a time: the same gradient as take's, on one device and with the vocabulary
    split over tensor and the width over fsdp (tests/children/embedding_pieces.py, 8 CPU devices)."""
    import os
    import subprocess

    from runtime_support import child, cpu_env

    here = os.path.dirname(os.path.abspath(__file__))
    env = cpu_env(8, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(child("embedding_pieces"), capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "embedding pieces ok" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


def test_no_whole_float32_gradient_where_it_is_formed_in_pieces(monkeypatch):
    """Compiled for TPU (v5p-16, fsdp 8): the gradient is formed as [1024, 256] pieces and no
    float32 buffer is the whole [4096, 256] table, where with one piece one is (the check fails
    without the pieces). Each device's float32 cotangent is [2048, 256]."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mxc.compiler.lower import embedding
    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.topology import device_mesh, devices, parse

    topology = parse("v5p-16")
    found = devices(topology)
    mesh = device_mesh(topology, ("fsdp",), (len(found),), found=found)
    rules = {"batch": ("fsdp",), "embed": ("fsdp",)}
    table = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    tokens = jax.ShapeDtypeStruct((64, 256), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None)))

    def float32_shapes(bound):
        monkeypatch.setattr(embedding, "WHOLE_GRADIENT_BYTES", bound)
        loss = lambda t, ids: jnp.sum(lookup(t, ids, jnp.bfloat16).astype(jnp.float32) ** 2)  # noqa: E731
        with use_rules(mesh, rules):
            text = jax.jit(jax.grad(loss)).lower(table, tokens).compile().as_text()
        return set(re.findall(r"= f32\[(\d+,\d+)\]", text))

    assert "4096,256" in float32_shapes(1 << 30)
    pieces = float32_shapes(4096 * 256 * 4 // 4)
    assert "4096,256" not in pieces and "1024,256" in pieces


def test_vocab_pieces_keep_a_piece_within_the_bound():
    from mxc.compiler.lower.embedding import WHOLE_GRADIENT_BYTES, vocab_pieces

    assert vocab_pieces((32000, 4096), 1) == 1  # 0.5 GB whole: one piece, as before
    # Llama 3.1 405B's table, 7.8 GiB in float32: eight pieces of 16032 rows.
    assert vocab_pieces((128256, 16384), 1) == 8
    assert vocab_pieces((128256, 16384), 4) == 2
    for shape, shards in (((128256, 16384), 1), ((151936, 8192), 2), ((262144, 5376), 1)):
        count = vocab_pieces(shape, shards)
        local = shape[0] // shards
        assert local % count == 0 and local // count * shape[1] * 4 <= WHOLE_GRADIENT_BYTES
