"""The same model on 8 virtual CPU devices (an fsdp × tensor mesh) matches one device.

XLA fixes the number of host devices when jax starts, so the sharded run happens in a child
process started with XLA_FLAGS; this file is also that child's script. The child measures and
prints JSON; the assertions stay here.
"""

import json

import pytest

from artifact_builds import child_report

MESH = {"fsdp": 4, "tensor": 2}
RULES = {"batch": ["data", "fsdp"], "embed": ["fsdp"], "vocab": ["tensor"], "heads": ["tensor"],
         "kv_heads": ["tensor"], "mlp": ["tensor"]}


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mxc.compiler.lower.model import forward
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.params import init_params, param_axes
    from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules
    from mxc.compiler.lower.train import (batch_from_sequences, init_train_state, make_train_step,
                                          train_state_shardings)
    from mxc.spec.load import load_model

    assert jax.device_count() == 8, jax.devices()
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    mesh = Mesh(np.array(jax.devices()).reshape(MESH["fsdp"], MESH["tensor"]), tuple(MESH))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, spec.vocab)
    batch = batch_from_sequences(tokens)
    params = init_params(spec, jax.random.key(0))
    report = {}

    # Forward: one device (plain jit, no rules) against the mesh (parameters placed by their
    # logical axes, activations constrained inside the model).
    single = jax.jit(lambda p, t: forward(spec, p, t)[0])(params, batch["inputs"])
    sharded_params = jax.device_put(params, tree_shardings(param_axes(spec), mesh, RULES))
    with use_rules(mesh, RULES):
        sharded = jax.jit(lambda p, t: forward(spec, p, t)[0])(
            sharded_params, jax.device_put(batch["inputs"], named_sharding(("batch", "seq"), mesh, RULES)))
    report["forward_max_abs_diff"] = float(jnp.abs(sharded - single).max())
    report["logits_max_abs"] = float(jnp.abs(single).max())
    report["logits_spec"] = list(sharded.sharding.spec)
    embedding = sharded_params["embed"]["embedding"]
    report["embedding_shard_shape"] = list(embedding.addressable_shards[0].data.shape)
    report["embedding_devices"] = len(embedding.sharding.device_set)

    # Two train steps with gradient accumulation, sharded versus on one device.
    config = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10)
    step = make_train_step(spec, config, microbatches=2, remat="minimal")
    state = init_train_state(spec, config, jax.random.key(0))
    state_shardings = train_state_shardings(spec, config, mesh, RULES)
    batch_shardings = jax.tree.map(lambda _: named_sharding(("batch", "seq"), mesh, RULES), batch)
    with use_rules(mesh, RULES):
        sharded_step = jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                               out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())))
        sharded_state = jax.device_put(state, state_shardings)
        for _ in range(2):
            sharded_batch = jax.device_put(batch, batch_shardings)
            sharded_state, sharded_metrics = sharded_step(sharded_state, sharded_batch)
    single_step = jax.jit(step)
    for _ in range(2):
        state, metrics = single_step(state, batch)
    report["loss"] = [float(metrics["loss"]), float(sharded_metrics["loss"])]
    report["grad_norm"] = [float(metrics["grad_norm"]), float(sharded_metrics["grad_norm"])]
    pairs = zip(jax.tree.leaves(state.params), jax.tree.leaves(sharded_state.params))
    report["params_max_abs_diff"] = max(float(jnp.abs(a - b).max()) for a, b in pairs)
    moments = [leaf for leaf in jax.tree.leaves(sharded_state.opt_state) if leaf.ndim >= 2]
    report["moment_specs"] = [list(leaf.sharding.spec) for leaf in moments]
    report["step"] = int(sharded_state.step)
    report["splash_max_abs_diff"] = _splash_under_rules(mesh)
    return report


def _splash_under_rules(mesh) -> dict:
    """The splash kernel inside shard_map (run by Pallas's interpreter) against the XLA core on
    one device: kv heads that split like the query heads, kv heads that cannot split (MQA), and
    a batch that cannot split over fsdp."""
    import jax
    import jax.numpy as jnp

    from mxc.compiler.lower.attention_core import attend
    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.lower.splash import splash_attend

    diffs = {}
    for name, (batch, kv_heads) in {"gqa": (4, 2), "mqa": (4, 1), "odd_batch": (2, 2)}.items():
        keys = jax.random.split(jax.random.key(kv_heads + batch), 3)
        q = jax.random.normal(keys[0], (batch, 128, 4, 16))
        k, v = (jax.random.normal(key, (batch, 128, kv_heads, 16)) for key in keys[1:])
        positions = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (batch, 128))
        options = dict(q_positions=positions, kv_positions=positions, scale=0.25, window=50,
                       sinks=jnp.asarray([0.1, -0.4, 0.7, 0.0]))
        reference = attend(q, k, v, **options)
        with use_rules(mesh, RULES):
            kernel = jax.jit(lambda q, k, v: splash_attend(q, k, v, interpret=True, **options))(q, k, v)
        diffs[name] = float(jnp.abs(kernel - reference).max())
    return diffs


@pytest.fixture(scope="module")
def report() -> dict:
    return child_report(__file__, timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                        JAX_PLATFORMS="cpu")


def test_forward_on_8_devices_equals_one_device(report):
    assert report["logits_max_abs"] > 0.01  # a real signal, not zeros
    assert report["forward_max_abs_diff"] < 1e-5


def test_parameters_and_activations_are_really_sharded(report):
    # embedding [vocab 512, embed 64]: vocab over tensor (2), embed over fsdp (4).
    assert report["embedding_shard_shape"] == [256, 16]
    assert report["embedding_devices"] == 8
    assert report["logits_spec"] == ["fsdp", None, "tensor"]


def test_sharded_train_step_equals_one_device(report):
    assert report["step"] == 2
    single, sharded = report["loss"]
    assert sharded == pytest.approx(single, rel=1e-5)
    assert report["grad_norm"][1] == pytest.approx(report["grad_norm"][0], rel=1e-4)
    # Adam moves an element by at most ~lr a step; reduction order shifts only near-zero gradients.
    assert report["params_max_abs_diff"] < 2e-5
    # Adam's moments follow their parameters' layouts instead of sitting replicated.
    assert report["moment_specs"] and all(any(spec) for spec in report["moment_specs"])


def test_splash_kernel_under_sharding_rules_equals_xla(report):
    for case, diff in report["splash_max_abs_diff"].items():
        assert diff < 1e-5, case


if __name__ == "__main__":
    print(json.dumps(_child()))
