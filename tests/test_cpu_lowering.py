"""The lowering's CPU choices compute what the plain program computes: values and gradients
agree to float32 rounding, and each choice is what a CPU plan (and only a CPU plan) picks."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.weight_gradients import weight_einsum
from mxc.compiler.plan import plan
from mxc.compiler.topology import parse
from mxc.spec.load import load_model

# (pattern, x shape, kernel shape): the weight products of the lowering, in both of the
# backward pass's orders (the kernel's input axis smaller and larger than its output).
PRODUCTS = [
    ("bse,ev->bsv", (2, 8, 16), (16, 40)),  # untied head
    ("bse,ve->bsv", (2, 8, 16), (40, 16)),  # tied head
    ("...i,io->...o", (2, 8, 24), (24, 12)),  # down projection: input wider than output
    ("bse,ehd->bshd", (2, 8, 16), (16, 3, 4)),  # attention's query
    ("bshd,hde->bse", (2, 8, 3, 4), (3, 4, 16)),  # attention's output
]


@pytest.mark.parametrize("pattern, x_shape, kernel_shape", PRODUCTS)
def test_weight_einsum_values_and_gradients_equal_the_plain_einsum(pattern, x_shape, kernel_shape):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], x_shape, jnp.float32)
    kernel = jax.random.normal(keys[1], kernel_shape, jnp.float32)
    out_shape = jax.eval_shape(lambda: jnp.einsum(pattern, x, kernel)).shape
    cotangent = jax.random.normal(keys[2], out_shape, jnp.float32)

    def loss(product):
        return lambda a, b: jnp.sum(product(a, b) * cotangent)

    plain = jax.value_and_grad(loss(lambda a, b: jnp.einsum(pattern, a, b)), argnums=(0, 1))(x, kernel)
    canonical = jax.value_and_grad(loss(lambda a, b: weight_einsum(pattern, a, b)), argnums=(0, 1))(x, kernel)
    np.testing.assert_allclose(canonical[0], plain[0], rtol=1e-5)
    for got, want in zip(canonical[1], plain[1]):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_head_gradient_is_not_copied_transposed():
    """The point of the choice: no [vocab, tokens] transpose of the logits' gradient."""
    tokens, embed, vocab = 64, 32, 4096
    x = jnp.ones((1, tokens, embed), jnp.float32)
    kernel = jnp.ones((embed, vocab), jnp.float32)

    def shapes_in_backward(product):
        grad = jax.grad(lambda a, b: jnp.sum(jnp.sin(product("bse,ev->bsv", a, b))), argnums=(0, 1))
        hlo = jax.jit(grad).lower(x, kernel).compile().as_text()
        return set(re.findall(r"f32\[(\d+,\d+)\]", hlo))

    transposed = f"{vocab},{tokens}"
    assert transposed in shapes_in_backward(jnp.einsum)  # what XLA:CPU does with the plain product
    assert transposed not in shapes_in_backward(weight_einsum)


@pytest.mark.parametrize("topology, cpu", [("cpu-8", True), ("cpu-1", True), ("v5p-8", False)])
def test_only_cpu_plans_choose_the_cpu_lowering(topology, cpu):
    chosen = plan(load_model("llama3-tiny"), parse(topology), seq=64, batch=16, verify=False)
    assert chosen.lowering_choices().canonical_weight_gradients is cpu
    assert (chosen.lowering_choices().causal_query_blocks > 1) is cpu


@pytest.mark.slow
def test_a_train_step_gives_the_same_loss_and_gradients_either_way():
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.train import model_loss_sums

    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    params = init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, spec.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 32), jnp.float32)}
    sums = model_loss_sums(spec, remat="minimal")

    def loss_and_grads(canonical: bool):
        choices = LoweringChoices(stacked_projections=False, interpret_kernels=True,
                                  canonical_weight_gradients=canonical)
        with use_lowering(choices):
            return jax.jit(jax.value_and_grad(lambda p: sums(p, batch).total()))(params)

    (plain_loss, plain_grads), (loss, grads) = loss_and_grads(False), loss_and_grads(True)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)


def test_fused_cross_entropy_equals_the_plain_loss_and_gradient():
    from mxc.compiler.lower.loss import loss_sums

    keys = jax.random.split(jax.random.key(0), 3)
    logits = 4 * jax.random.normal(keys[0], (2, 5, 37), jnp.float32)
    targets = jax.random.randint(keys[1], (2, 5), 0, 37)
    mask = jax.random.bernoulli(keys[2], 0.7, (2, 5))

    def sums_and_gradient(fused: bool):
        choices = LoweringChoices(stacked_projections=False, interpret_kernels=True, fused_cross_entropy=fused)

        def total(x):
            sums = loss_sums(x, targets, mask, z_loss_weight=1e-3)
            return sums.total(), sums

        with use_lowering(choices):
            return jax.jit(jax.grad(total, has_aux=True))(logits)

    (plain_gradient, plain), (gradient, fused) = sums_and_gradient(False), sums_and_gradient(True)
    for name in ("cross_entropy", "z_loss", "correct", "tokens"):
        np.testing.assert_allclose(getattr(fused, name), getattr(plain, name), rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(gradient, plain_gradient, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", ["minimal_with_context", "minimal"])
def test_the_dot_saving_remat_policies_keep_the_canonical_weight_products(remat):
    """A canonical weight product is a custom VJP, not a dot: without its checkpoint name the
    "minimal" policies recompute the layers' projections in the backward pass (six more products
    in llama3-tiny's step). Kept, the step has as many products as the plain program's."""
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.train import model_loss_sums

    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    params = jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))
    tokens = jnp.zeros((2, 33), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 32), jnp.float32)}
    sums = model_loss_sums(spec, remat=remat)

    def products(canonical: bool) -> int:
        choices = LoweringChoices(stacked_projections=False, interpret_kernels=True,
                                  canonical_weight_gradients=canonical)
        with use_lowering(choices):
            step = jax.jit(jax.value_and_grad(lambda p: sums(p, batch).total()))
            return step.lower(params).as_text().count("stablehlo.dot_general")

    assert products(True) == products(False)


# (heads, kv_heads, sinks, softcap, window): MHA as the bench models; GQA with a GPT-OSS-style
# sink, a soft cap and a sliding window.
ATTENTIONS = [(4, 4, False, None, None), (6, 2, True, 30.0, 40)]


@pytest.mark.parametrize("heads, kv_heads, sinks, softcap, window", ATTENTIONS)
def test_attention_in_query_blocks_equals_the_one_block_core(heads, kv_heads, sinks, softcap, window):
    """Two packed documents per row (segment ids, positions restarting): values and gradients of
    the blocked core equal the one-block core's to float32 rounding (3 does not divide 64: two
    blocks)."""
    from mxc.compiler.lower.attention_blocks import attend_in_query_blocks
    from mxc.compiler.lower.attention_core import attend

    batch, seq, head_dim = 2, 64, 16
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.float32)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), jnp.float32) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    sink = jax.random.normal(keys[4], (heads,), jnp.float32) if sinks else None
    segment_ids = jnp.asarray([[1] * 23 + [2] * 41, [1] * 64], jnp.int32)
    positions = jnp.asarray([list(range(23)) + list(range(41)), list(range(64))], jnp.int32)
    settings = dict(q_positions=positions, kv_positions=positions, scale=head_dim ** -0.5, window=window,
                    chunk=None, softcap=softcap, segment_ids=segment_ids)

    def loss(core):
        return jax.jit(jax.value_and_grad(lambda q, k, v, s: jnp.sum(core(q, k, v, s) * cotangent),
                                          argnums=(0, 1, 2, 3) if sinks else (0, 1, 2)))

    want = loss(lambda q, k, v, s: attend(q, k, v, sinks=s, **settings))(q, k, v, sink)
    for blocks in (3, 4):
        got = loss(lambda q, k, v, s: attend_in_query_blocks(q, k, v, sinks=s, blocks=blocks, **settings))(q, k, v, sink)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{blocks} blocks")


def test_a_cpu_train_step_skips_the_scores_above_the_diagonal_blocks():
    """The point of the choice: in four query blocks the step's attention products cover 5/8 of
    the [seq, seq] scores, so the lowered step counts fewer FLOPs."""
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.train import model_loss_sums

    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    params = jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))
    tokens = jnp.zeros((2, 129), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 128), jnp.float32)}
    sums = model_loss_sums(spec, remat="minimal_with_context")

    def flops(blocks: int) -> float:
        with use_lowering(dataclasses.replace(LoweringChoices.for_platform("cpu"), causal_query_blocks=blocks)):
            cost = jax.jit(jax.value_and_grad(lambda p: sums(p, batch).total())).lower(params).cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(4) < flops(1)
