"""Keys with values and gate with up as one matmul over stacked kernels (the TPU lowering)
compute what the separate projections compute, forward and backward; and the choice follows
the target: stacked on a TPU mesh, apart on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import init_params
from mxc.compiler.lower.stacking import force_stacked_projections, stacked_projections
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
