"""The dropless path with unsplit experts, each batch shard sorting its own tokens for megablox's
grouped matmul (Pallas' interpreter here), on 8 virtual CPU devices against one device.

    python dropless_batch_shards.py FAMILY...   (test_moe.MOES' names)

Run with 8 virtual CPU devices (XLA_FLAGS) and the tests folder on PYTHONPATH. On a mesh whose
devices all split the batch (fsdp 8, the weights' embed dimension split too, as an FSDP plan
has it) the region is manual over every axis and megablox runs in it, also where a tensor axis
splits the experts' hidden units (each device's slice, the outputs summed); where a tensor axis
splits nothing of the experts the lowering falls back to ragged_dot. Outputs, loss, statistics and gradients equal the
one-device dropless path (ragged_dot), float32 to 1e-4 of the largest value. Prints
"dropless batch shards ok"."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import test_moe as t
from dropless_ep import close, loss_and_grads
from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.moe import MoEConfig
from mxc.compiler.lower.params import moe_defs
from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules

# (mesh shape, axis names, rules, whether megablox runs)
LAYOUTS = [
    ((8,), ("fsdp",), {"batch": ("fsdp",), "embed": ("fsdp",)}, True),
    # tensor splits the experts' hidden units: megablox on each slice, the outputs summed
    ((4, 2), ("fsdp", "tensor"), {"batch": ("fsdp",), "embed": ("fsdp",), "mlp": ("tensor",)}, True),
    # tensor splits nothing of the experts: the partitioner's ragged_dot
    ((4, 2), ("fsdp", "tensor"), {"batch": ("fsdp",), "embed": ("fsdp",)}, False),
]
MEGABLOX = dataclasses.replace(LoweringChoices.for_platform("cpu"), grouped_matmul="megablox", interpret_kernels=True)


def main(names: list[str]) -> None:
    assert len(jax.devices()) == 8, "run with --xla_force_host_platform_device_count=8"
    for name in names:
        moe, params, x = t._layer(name)
        x = jnp.concatenate([x, x[:1] * 0.5, x[1:2] * -1.0, x[2:], x[:2] * 2.0])  # 8 sequences
        (ref_loss, (ref_y, ref_stats)), ref_grads = jax.jit(loss_and_grads(moe, params, x, MoEConfig()))(params, x)
        axes = jax.tree.map(lambda d: d.axes, moe_defs(moe, t.D_MODEL), is_leaf=lambda d: hasattr(d, "axes"))
        for shape, names, rules, megablox in LAYOUTS:
            mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
            sharded = jax.device_put(params, tree_shardings(axes, mesh, rules))
            sharded_x = jax.device_put(x, named_sharding(("batch", "seq", "embed"), mesh, rules))
            with use_rules(mesh, rules), use_lowering(MEGABLOX):
                lowered = jax.jit(loss_and_grads(moe, params, x, MoEConfig())).lower(sharded, sharded_x)
                (loss, (y, stats)), grads = lowered.compile()(sharded, sharded_x)
            what = f"{name} {shape} {rules}"
            # Pallas' interpreter runs the kernel's grid as loops; ragged_dot is a masked dot.
            kernel = "stablehlo.while" in lowered.as_text()
            print(what, "megablox" if kernel else "ragged_dot", flush=True)
            # A bias on `down` would be added once per hidden slice: such experts keep ragged_dot.
            expected = megablox and not ("mlp" in rules and "bias" in params["experts"]["down"])
            assert kernel == expected, f"{what}: megablox {'in' if kernel else 'not in'} the program"
            close(y, ref_y, what + ": outputs")
            close(loss, ref_loss, what + ": loss")
            close(grads, ref_grads, what + ": gradients")
            np.testing.assert_array_equal(stats.expert_load, ref_stats.expert_load, err_msg=what)
            np.testing.assert_allclose(stats.aux_loss, ref_stats.aux_loss, rtol=1e-6, err_msg=what)
        print(name, "ok", flush=True)
    print("dropless batch shards ok")


if __name__ == "__main__":
    main(sys.argv[1:])
