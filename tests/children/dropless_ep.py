"""The dropless path with expert parallelism on 8 virtual CPU devices against one device.

    python dropless_ep.py FAMILY...   (test_moe.MOES' names)

Run with 8 virtual CPU devices (XLA_FLAGS) and the tests folder on PYTHONPATH (it builds its
layers with test_moe's helpers). For expert axes of 2 and 4 (the batch split over the expert
axis or not, the hidden units split over `tensor` or not), every router family's outputs,
statistics and gradients equal the one-device dropless path and the capacity path with room for
every assignment (float32, to 1e-4 of the largest value: the sums run in another order); the
compiled program exchanges tokens with all-to-alls. Prints "dropless ep ok"."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import test_moe as t
from mxc.compiler.lower.moe import MoEConfig, moe_layer
from mxc.compiler.lower.params import moe_defs
from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules

LAYOUTS = [
    ((4, 2), ("data", "expert"), {"batch": ("data",), "experts": ("expert",)}),
    ((2, 4), ("data", "expert"), {"batch": ("data", "expert"), "experts": ("expert",)}),
    ((2, 2, 2), ("data", "expert", "tensor"), {"batch": ("data",), "experts": ("expert",), "mlp": ("tensor",)}),
]


def loss_and_grads(moe, params, x, config):
    def loss(p, x):
        y, stats = moe_layer(moe, p, x, config)
        return jnp.sum(jnp.sin(y)) + stats.aux_loss, (y, stats)

    return jax.value_and_grad(loss, has_aux=True)


def close(a, b, what):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        scale = max(1.0, float(jnp.max(jnp.abs(v))))
        error = float(jnp.max(jnp.abs(u - v)))
        assert error <= 1e-4 * scale, f"{what}: {error} against a scale of {scale}"


def main(names: list[str]) -> None:
    assert len(jax.devices()) == 8, "run with --xla_force_host_platform_device_count=8"
    for name in names:
        moe, params, x = t._layer(name)
        x = jnp.concatenate([x, x[:1] * 0.5, x[1:2] * -1.0, x[2:], x[:2] * 2.0])  # 8 sequences
        references = {
            "dropless": jax.jit(loss_and_grads(moe, params, x, MoEConfig()))(params, x),
            "capacity": jax.jit(loss_and_grads(moe, params, x, MoEConfig(path="capacity",
                                                                          capacity_factor=float(moe.experts))))(params, x),
        }
        assert float(references["capacity"][0][1][1].dropped) == 0
        axes = jax.tree.map(lambda d: d.axes, moe_defs(moe, t.D_MODEL), is_leaf=lambda d: hasattr(d, "axes"))
        for shape, names, rules in LAYOUTS:
            mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
            sharded = jax.device_put(params, tree_shardings(axes, mesh, rules))
            sharded_x = jax.device_put(x, named_sharding(("batch", "seq", "embed"), mesh, rules))
            with use_rules(mesh, rules):
                step = jax.jit(loss_and_grads(moe, params, x, MoEConfig())).lower(sharded, sharded_x).compile()
                (loss, (y, stats)), grads = step(sharded, sharded_x)
            assert "all-to-all" in step.as_text(), f"{name} {shape}: no all-to-all in the compiled program"
            for path, ((ref_loss, (ref_y, ref_stats)), ref_grads) in references.items():
                what = f"{name} {shape} {rules} against {path}"
                close(y, ref_y, what + ": outputs")
                close(loss, ref_loss, what + ": loss")
                close(grads, ref_grads, what + ": gradients")
                np.testing.assert_array_equal(stats.expert_load, ref_stats.expert_load, err_msg=what)
                np.testing.assert_allclose(stats.aux_loss, ref_stats.aux_loss, rtol=1e-6, err_msg=what)
                assert float(stats.dropped) == 0, what
        print(name, "ok", flush=True)
    print("dropless ep ok")


if __name__ == "__main__":
    main(sys.argv[1:])
