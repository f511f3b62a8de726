"""FLOPs of an MoE layer compiled for TPU slices (libtpu's descriptions of v5e:2x2 and v5p:2x2x1,
no TPU needed) on the dropless path with expert parallelism, its exchange a ragged all-to-all (as TPU
plans choose), its grouped matmul XLA's ragged_dot or megablox.

    python moe_tpu_flops.py

Prints both counts and the useful FLOPs, then "tpu ok" when megablox stays near the useful count
and ragged_dot is at least 4 times megablox; otherwise raises."""

import dataclasses
import os

os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # read when jax loads libtpu: before the import

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from mxc.compiler.lower.choices import LoweringChoices, use_lowering  # noqa: E402
from mxc.compiler.lower.moe import MoEConfig, moe_layer  # noqa: E402
from mxc.compiler.lower.params import moe_defs  # noqa: E402
from mxc.compiler.lower.sharding import named_sharding, use_rules  # noqa: E402
from mxc.spec.ir import GLU, MoE, Router  # noqa: E402


def layer_flops(topology: str) -> dict[str, float]:
    """FLOPs per device of the dropless layer on a 2 x 2 (data, expert) mesh of `topology`, for
    each grouped matmul; checks that the program exchanges rows with a ragged all-to-all."""
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "expert"))
    rules = {"batch": ("data",), "experts": ("expert",)}
    params = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=named_sharding(p.axes, mesh, rules)),
        moe_defs(MOE, D_MODEL), is_leaf=lambda p: hasattr(p, "axes"))
    x = jax.ShapeDtypeStruct((BATCH, SEQ, D_MODEL), jnp.bfloat16,
                             sharding=named_sharding(("batch", "seq", "embed"), mesh, rules))
    flops = {}
    for kind in ("ragged_dot", "megablox"):
        choices = dataclasses.replace(LoweringChoices.for_platform("tpu"), grouped_matmul=kind)
        with use_rules(mesh, rules), use_lowering(choices):
            lowered = jax.jit(lambda p, x: moe_layer(MOE, p, x, MoEConfig())[0]).lower(params, x)
            compiled = lowered.compile()
        flops[kind] = compiled.cost_analysis()["flops"]
        # (XLA cannot print this compiled program: "async-update instruction should have 1 operands")
        assert "ragged_all_to_all" in lowered.as_text(), f"{topology} {kind}: no ragged all-to-all"
    return flops


MOE = MoE(experts=8, top_k=2, expert=GLU(hidden=1024, act="silu"), router=Router(score="softmax", normalize=True))
D_MODEL, BATCH, SEQ = 512, 8, 1024


def main() -> None:
    # Per device: its data shard's tokens · top_k rows, three matmuls of 2 · d_model · hidden
    # FLOPs, split over the 2 expert shards.
    useful = BATCH // 2 * SEQ * MOE.top_k * 3 * 2 * D_MODEL * 1024 / 2
    v5e, v5p = layer_flops("v5e:2x2"), layer_flops("v5p:2x2x1")
    print("flops v5e", v5e, "v5p", v5p, "useful", useful)
    # megablox's cost estimate counts every row of the receive buffer (twice the rows sent here);
    # on v5e XLA's ragged_dot runs every local expert over every row (about 4x megablox). On v5p
    # XLA counts ragged_dot as megablox (measured: 1.00x), so only megablox's bound is checked.
    assert v5e["megablox"] <= 2.1 * useful and v5e["ragged_dot"] >= 3.5 * v5e["megablox"], v5e
    assert v5p["megablox"] <= 2.1 * useful, v5p
    print("tpu ok")


if __name__ == "__main__":
    main()
