"""Offloaded residual-shaped values are pinned to the row-major layout the backward pass reads
(remat.named_residual): left free, XLA's TPU backend writes their scanned stacks to host with the
sequence minor and copies each whole stack back to HBM to lay it out again between the passes
(docs/plans.md, "Memory levers"). The pin must change nothing else: the loss and every gradient
equal the plain program's, and programs that offload nothing are untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from mxc.compiler.lower import remat
from mxc.spec.load import load_model

OFFLOAD = "offload"
MAXTEXT_8B = remat.custom(decoder_layer_input=OFFLOAD, query_proj=OFFLOAD, key_proj=OFFLOAD, value_proj=OFFLOAD,
                          out_proj=OFFLOAD)


def _loss_and_gradients(policy: str, lowered: bool = False):
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.train import model_loss_sums

    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    params = init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, spec.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 32), jnp.float32)}
    sums = model_loss_sums(spec, remat=policy)
    step = jax.jit(jax.value_and_grad(lambda p: sums(p, batch).total()))
    return step.lower(params).as_text() if lowered else step(params)


def test_offloaded_residuals_are_pinned_to_the_backward_layout_only_where_offloaded():
    assert remat.host_memory_available()  # the CPU backend's pinned_host: the offloading program runs
    pinned = _loss_and_gradients(MAXTEXT_8B, lowered=True).count("@LayoutConstraint")
    assert pinned > 0
    assert _loss_and_gradients(remat.custom(query_proj=OFFLOAD), lowered=True).count("@LayoutConstraint") == 0
    assert _loss_and_gradients("full", lowered=True).count("@LayoutConstraint") == 0


@pytest.mark.parametrize("policy", [MAXTEXT_8B, remat.custom(decoder_layer_input=OFFLOAD, mlpwo=OFFLOAD)])
def test_pinned_offloaded_residuals_give_the_plain_loss_and_gradients(policy):
    (value, grads), (plain, plain_grads) = _loss_and_gradients(policy), _loss_and_gradients("none")
    assert float(jnp.abs(value - plain)) <= 1e-6 * max(1.0, float(jnp.abs(plain)))
    leaves, plain_leaves = jax.tree.leaves(grads), jax.tree.leaves(plain_grads)
    assert len(leaves) == len(plain_leaves) > 5
    for a, b in zip(leaves, plain_leaves):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * max(1.0, float(jnp.abs(b).max()))
