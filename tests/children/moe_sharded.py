"""MoE layers and a whole MoE model sharded over 8 devices against the one-device dense reference.

    python moe_sharded.py paths|training

Run with 8 virtual CPU devices (XLA_FLAGS) and the tests folder on PYTHONPATH (it builds its
layers with test_moe's helpers). `paths`: the dropless and capacity paths, and the dropless
dispatch with megablox's grouped matmul under two more layouts; `training`: gradients through the
layer, a model's logits and a whole train step.
Prints "sharded ok" when every comparison holds; a failed one raises."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import test_moe as t
from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.model import forward
from mxc.compiler.lower.moe import MoEConfig, moe_layer
from mxc.compiler.lower.params import init_params, moe_defs, param_axes
from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules
from mxc.spec.load import load_model

RULES = {"batch": ("data",), "experts": ("expert",)}


def data_expert_mesh() -> Mesh:
    assert len(jax.devices()) == 8, "run with --xla_force_host_platform_device_count=8"
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))


def expert_axes(moe):
    return jax.tree.map(lambda d: d.axes, moe_defs(moe, t.D_MODEL), is_leaf=lambda d: hasattr(d, "axes"))


def sharded_layer(name: str, mesh: Mesh):
    moe, params, x = t._layer(name)
    x = jnp.concatenate([x, x[:1]])  # 4 sequences: 2 per data shard
    shardings = tree_shardings(expert_axes(moe), mesh, RULES)
    assert shardings["experts"]["up"]["kernel"].spec[0] == "expert"
    return moe, params, x, jax.device_put(params, shardings), jax.device_put(
        x, named_sharding(("batch", "seq", "embed"), mesh, RULES))


def check_paths(mesh: Mesh) -> None:
    for name in ("llama4", "gpt_oss", "deepseek3"):
        moe, params, x, sharded_params, sharded_x = sharded_layer(name, mesh)
        reference, reference_stats = moe_layer(moe, params, x, MoEConfig(path="dense"))
        for path in ("dropless", "capacity"):
            config = MoEConfig(path=path, capacity_factor=float(moe.experts))
            with use_rules(mesh, RULES):
                y, stats = jax.jit(lambda p, x: moe_layer(moe, p, x, config))(sharded_params, sharded_x)
            np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5, err_msg=f"{name} {path}")
            # Statistics are of the whole batch, not of one shard.
            np.testing.assert_array_equal(stats.expert_load, reference_stats.expert_load)
            np.testing.assert_allclose(stats.aux_loss, reference_stats.aux_loss, rtol=1e-6)
            assert float(stats.dropped) == 0

    # megablox's kernel as the dispatch's grouped matmul (Pallas' interpreter here, as the TPU
    # plans choose it): also with the hidden units split over `tensor`, and with the batch split
    # over the expert axis too.
    megablox = dataclasses.replace(LoweringChoices.for_platform("cpu"), grouped_matmul="megablox")
    layouts = [((2, 2, 2), ("data", "expert", "tensor"),
                {"batch": ("data",), "experts": ("expert",), "mlp": ("tensor",)}),
               ((2, 4), ("data", "expert"), {"batch": ("data", "expert"), "experts": ("expert",)})]
    for name in ("gpt_oss", "deepseek3"):
        moe, params, x = t._layer(name)
        x = jnp.concatenate([x, x, x[:2]])  # 8 sequences
        reference, reference_stats = moe_layer(moe, params, x, MoEConfig(path="dense"))
        for shape, names, layout in layouts:
            grid = Mesh(np.array(jax.devices()).reshape(shape), names)
            sharded = jax.device_put(params, tree_shardings(expert_axes(moe), grid, layout))
            with use_rules(grid, layout), use_lowering(megablox):
                y, stats = jax.jit(lambda p, x: moe_layer(moe, p, x, MoEConfig()))(
                    sharded, jax.device_put(x, named_sharding(("batch", "seq", "embed"), grid, layout)))
            np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5, err_msg=f"{name} {shape}")
            np.testing.assert_array_equal(stats.expert_load, reference_stats.expert_load)


def check_training(mesh: Mesh) -> None:
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import batch_from_sequences, init_train_state, make_train_step, train_state_shardings

    for name in ("llama4", "deepseek3"):
        moe, params, x, sharded_params, sharded_x = sharded_layer(name, mesh)

        # Gradients flow through the per-shard region and its summed statistics unchanged.
        def loss(p, x):
            y, stats = moe_layer(moe, p, x, MoEConfig())
            return jnp.sum(jnp.sin(y)) + stats.aux_loss

        expected = jax.grad(loss)(params, x)
        with use_rules(mesh, RULES):
            grads = jax.jit(jax.grad(loss))(sharded_params, sharded_x)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)

    spec = load_model("moe-tiny")
    params = init_params(spec, jax.random.key(0), 0.1)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, spec.vocab)
    reference = forward(spec, params, tokens, dtype="float32", moe=MoEConfig(path="dense"))[0]
    params = jax.device_put(params, tree_shardings(param_axes(spec), mesh, RULES))
    with use_rules(mesh, RULES):
        logits = jax.jit(lambda p, t: forward(spec, p, t, dtype="float32")[0])(params, tokens)
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)

    # A whole train step (scanned layers, remat, aux loss) sharded equals the one-device step.
    spec = spec.model_copy(update={"compute_dtype": "float32"})
    config = OptimizerConfig(learning_rate=1e-3, total_steps=10, warmup_steps=1)
    state = init_train_state(spec, config, jax.random.key(0))
    batch = batch_from_sequences(jax.random.randint(jax.random.key(2), (8, 17), 0, spec.vocab))
    step = make_train_step(spec, config, moe=MoEConfig(aux_loss_weight=0.1))
    expected_state, expected = jax.jit(step)(state, batch)
    with use_rules(mesh, RULES):
        sharded_state = jax.device_put(state, train_state_shardings(spec, config, mesh, RULES))
        sharded_batch = jax.device_put(batch, named_sharding(("batch", None), mesh, RULES))
        new_state, metrics = jax.jit(step)(sharded_state, sharded_batch)
    for key in ("loss", "aux_loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


CHECKS = {"paths": check_paths, "training": check_training}


def main(which: str) -> None:
    CHECKS[which](data_expert_mesh())
    print("sharded ok")


if __name__ == "__main__":
    main(sys.argv[1])
