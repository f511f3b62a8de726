"""Weight products gathered over the fsdp axes (compiler/lower/fsdp_gather.py) on 8 virtual CPU
devices: the loss and every gradient of a tiny Llama equal the plain program's, and the compiled
program reduce-scatters the layers' weight gradients where the plain one all-reduces them.

XLA fixes the number of host devices when jax starts, so the work happens in a child process
started with XLA_FLAGS; this file is also that child's script.
"""

import json

import pytest

from artifact_builds import child_report

RULES = {"batch": ["data", "fsdp"], "embed": ["fsdp"], "vocab": ["tensor"], "heads": ["tensor"],
         "kv_heads": ["tensor"], "mlp": ["tensor"]}
MESHES = {"fsdp8": (1, 8, 1), "data2_fsdp4": (2, 4, 1), "fsdp4_tensor2": (1, 4, 2)}  # (data, fsdp, tensor)
# (mesh, stacked): separate q/k/v and gate/up products (CPU plans) or stacked ones (TPU plans)
CASES = [("fsdp8", False), ("fsdp8", True), ("data2_fsdp4", True), ("fsdp4_tensor2", True)]


def _collective_bytes(text: str, devices: int) -> dict:
    from mxc.compiler.plan.hlo_cost import program_cost

    totals = {}
    for collective in program_cost(text, devices).collectives:
        totals[collective.kind] = totals.get(collective.kind, 0.0) + collective.bytes * collective.count
    return totals


def _child() -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from mxc.compiler.lower.choices import LoweringChoices, use_lowering
    from mxc.compiler.lower.model import forward
    from mxc.compiler.lower.params import init_params, param_axes
    from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules
    from mxc.spec.load import load_model

    assert jax.device_count() == 8, jax.devices()
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    params = init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, spec.vocab)

    def loss(p, t):
        logits = forward(spec, p, t[:, :-1], remat_policy=jax.checkpoint_policies.nothing_saveable)[0]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1))

    report = {}
    for name, stacked in CASES:
        mesh = Mesh(np.array(jax.devices()).reshape(MESHES[name]), ("data", "fsdp", "tensor"))
        sharded_params = jax.device_put(params, tree_shardings(param_axes(spec), mesh, RULES))
        sharded_tokens = jax.device_put(tokens, named_sharding(("batch", "seq"), mesh, RULES))
        results = {}
        for gathered in (False, True):
            choices = dataclasses.replace(LoweringChoices.for_platform("cpu"), canonical_weight_gradients=False,
                                          stacked_projections=stacked,
                                          reduce_scattered_weight_gradients=gathered)
            with use_rules(mesh, RULES), use_lowering(choices):
                step = jax.jit(jax.value_and_grad(loss))
                value, grads = step(sharded_params, sharded_tokens)
                text = step.lower(sharded_params, sharded_tokens).compile().as_text()
            results[gathered] = (value, grads, _collective_bytes(text, 8))
        (v0, g0, c0), (v1, g1, c1) = results[False], results[True]
        report[f"{name}/stacked={stacked}"] = {
            "loss": [float(v0), float(v1)],
            "grad_max_abs_diff": max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g0),
                                                                                   jax.tree.leaves(g1))),
            "grad_max_abs": max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g0)),
            "plain": c0, "gathered": c1}
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return child_report(__file__, timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                        JAX_PLATFORMS="cpu")


@pytest.mark.parametrize("case", [f"{m}/stacked={s}" for m, s in CASES])
def test_gathered_products_give_the_same_loss_and_gradients(report, case):
    row = report[case]
    assert row["grad_max_abs"] > 1e-4  # real gradients, not zeros
    assert row["loss"][0] == pytest.approx(row["loss"][1], rel=1e-6)
    assert row["grad_max_abs_diff"] < 1e-6 * max(1.0, row["grad_max_abs"])


@pytest.mark.parametrize("case", [f"{m}/stacked={s}" for m, s in CASES])
def test_weight_gradients_are_reduce_scattered(report, case):
    plain, gathered = report[case]["plain"], report[case]["gathered"]
    # The plain program all-reduces the layers' weight gradients whole; gathered, they leave the
    # layer reduce-scattered and the all-reduced bytes fall (what remains: the embedding's, the
    # head's, norm scales', the data axis's sum of the scattered pieces, activations' over tensor).
    assert plain.get("reduce-scatter", 0.0) == 0.0
    assert gathered.get("reduce-scatter", 0.0) > 0.0
    assert gathered.get("all-reduce", 0.0) < plain.get("all-reduce", 0.0)


if __name__ == "__main__":
    print(json.dumps(_child()))
