"""Query, keys and values joined, keys with values and gate with up stacked: one matmul over
their kernels (the TPU lowering) computes what the separate projections compute, forward and
backward; and the choice follows the target: stacked on a TPU mesh, apart on CPU, the query
joined only where no mesh axis splits heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import init_params
from mxc.compiler.lower.stacking import (force_stacked_projections, heads_unsplit, project_joined,
                                        project_pair, stacked_projections)
from mxc.spec.load import load_model, load_text


@pytest.mark.parametrize("biases", [False, True])
def test_stacked_projections_equal_separate_ones(biases):
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    if biases:  # Qwen2-style q/k/v biases and a GLU with biases, as GPT-OSS has
        spec = load_text("""model biased extends llama3-tiny {
            block x 2 {
              attention.qkv_bias = true
              mlp.bias = true
            }
        }""")["biased"].model_copy(update={"compute_dtype": "float32"})
    params = init_params(spec, jax.random.key(0))
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert any("'k']['bias']" in p for p in paths) == biases and any("'gate']['bias']" in p for p in paths) == biases
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, spec.vocab)

    def loss(p):
        return jnp.mean(forward(spec, p, tokens)[0] ** 2)

    results = {}
    for stacked in (False, True):
        with force_stacked_projections(stacked):
            results[stacked] = jax.jit(jax.value_and_grad(loss))(params)
    (apart, apart_grads), (joined, joined_grads) = results[False], results[True]
    np.testing.assert_allclose(joined, apart, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(joined_grads), jax.tree.leaves(apart_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_stacking_follows_the_target():
    from jax.sharding import Mesh

    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.topology import devices, parse

    assert not stacked_projections()  # no mesh: a plain jit on this host
    with use_rules(Mesh(np.array(jax.devices("cpu")[:1]), ("fsdp",)), {}):
        assert not stacked_projections()
    with use_rules(Mesh(np.array(devices(parse("v5e-1"))), ("fsdp",)), {}):
        assert stacked_projections()


def test_joined_and_paired_projections_equal_separate_ones():
    keys = jax.random.split(jax.random.key(2), 7)
    x = jax.random.normal(keys[0], (2, 5, 16))
    q, k, v = ({"kernel": jax.random.normal(key, (16, heads, 4)), "bias": jax.random.normal(bias, (heads, 4))}
               for key, bias, heads in zip(keys[1:4], keys[4:7], (6, 2, 2)))
    del q["bias"]  # a projection without a bias beside ones with

    def separate(x, q, k, v):
        return tuple(jnp.einsum("bse,ehd->bshd", x, p["kernel"]) + p.get("bias", 0.0) for p in (q, k, v))

    def joined(x, q, k, v):
        return project_joined(x, [q, k, v], jnp.float32, "bse,ehd->bshd")

    def paired(x, q, k, v):
        return (separate(x, q, k, v)[0], *project_pair(x, k, v, jnp.float32, "bse,ekhd->kbshd"))

    def loss(fn):
        return lambda *args: sum(jnp.sum(jnp.sin(y)) for y in fn(*args))

    expected = separate(x, q, k, v)
    expected_grads = jax.grad(loss(separate), argnums=(0, 1, 2, 3))(x, q, k, v)
    for fn in (joined, paired):
        for got, want in zip(fn(x, q, k, v), expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        grads = jax.grad(loss(fn), argnums=(0, 1, 2, 3))(x, q, k, v)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_query_joins_only_where_heads_are_whole():
    from jax.sharding import Mesh

    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.topology import devices, parse

    found = np.array(devices(parse("v5p-8"))).reshape(2, 2)
    tensor_rules = {"embed": ("fsdp",), "heads": ("tensor",), "kv_heads": ("tensor",)}
    assert heads_unsplit()  # no mesh
    with use_rules(Mesh(found, ("fsdp", "tensor")), tensor_rules):
        assert stacked_projections() and not heads_unsplit()
    with use_rules(Mesh(found.reshape(4, 1), ("fsdp", "tensor")), tensor_rules):
        assert heads_unsplit()  # a tensor axis of one device splits nothing
    with use_rules(Mesh(found, ("fsdp", "data")), {"embed": ("fsdp",), "batch": ("data",)}):
        assert heads_unsplit()
