"""FLOPs of an MoE layer compiled for a TPU slice (libtpu's description of v5e:2x2, no TPU
needed), with XLA's ragged_dot and with megablox.

    python moe_tpu_flops.py

Prints both counts and the useful FLOPs, then "tpu ok" when megablox stays near the useful count
and ragged_dot is at least 4 times megablox; otherwise raises."""

import os

os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # read when jax loads libtpu: before the import

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from mxc.compiler.lower.moe import MoEConfig, moe_layer  # noqa: E402
from mxc.compiler.lower.params import moe_defs  # noqa: E402
from mxc.compiler.lower.sharding import named_sharding, use_rules  # noqa: E402
from mxc.spec.ir import GLU, MoE, Router  # noqa: E402


def main() -> None:
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "expert"))
    rules = {"batch": ("data",), "experts": ("expert",)}
    moe = MoE(experts=8, top_k=2, expert=GLU(hidden=1024, act="silu"),
              router=Router(score="softmax", normalize=True))
    d_model, batch, seq = 512, 8, 1024
    params = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=named_sharding(p.axes, mesh, rules)),
        moe_defs(moe, d_model), is_leaf=lambda p: hasattr(p, "axes"))
    x = jax.ShapeDtypeStruct((batch, seq, d_model), jnp.bfloat16,
                             sharding=named_sharding(("batch", "seq", "embed"), mesh, rules))
    flops = {}
    for kind in ("ragged_dot", "megablox"):
        with use_rules(mesh, rules):
            layer = jax.jit(lambda p, x: moe_layer(moe, p, x, MoEConfig(grouped_matmul=kind))[0])
            compiled = layer.lower(params, x).compile()
        flops[kind] = compiled.cost_analysis()["flops"]
    # Per device: its data shard's tokens · top_k rows, three matmuls of 2 · d_model · hidden
    # FLOPs, split over the 2 expert shards.
    useful = batch // 2 * seq * moe.top_k * 3 * 2 * d_model * 1024 / 2
    print("flops", flops, "useful", useful)
    # megablox's cost estimate counts every row of the shard (its grid skips other devices'
    # experts); XLA's ragged_dot runs every local expert over every row it is sent (about 4x
    # megablox here: 3.98x since the dropless path dispatches rows to their experts' devices).
    assert flops["megablox"] <= 2.1 * useful and flops["ragged_dot"] >= 3.5 * flops["megablox"], flops
    print("tpu ok")


if __name__ == "__main__":
    main()
