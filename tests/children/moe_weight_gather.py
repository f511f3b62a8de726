"""How the expert weights enter the dropless batch shards' region (compiler/lower/moe.py,
_expert_inputs): on 8 virtual CPU devices, fsdp 8, megablox in Pallas' interpreter, bfloat16
activations over float32 weights. Each weight enters as its stored shard, is cast to bfloat16
there and gathered inside: the program gathers bfloat16 weights, and the transpose of that
gather reduce-scatters each expert weight's gradient in bfloat16, with no all-reduce of a whole
expert weight. Prints "moe weight gather ok".

    python moe_weight_gather.py   (the tests folder on PYTHONPATH)"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import test_moe as t
from dropless_ep import loss_and_grads
from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.moe import MoEConfig
from mxc.compiler.lower.params import moe_defs
from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules

RULES = {"batch": ("fsdp",), "embed": ("fsdp",)}
MEGABLOX = dataclasses.replace(LoweringChoices.for_platform("cpu"), grouped_matmul="megablox", interpret_kernels=True)


def main() -> None:
    assert len(jax.devices()) == 8, "run with --xla_force_host_platform_device_count=8"
    moe, params, x = t._layer("mixtral")
    x = jnp.concatenate([x, -x, 0.5 * x])[:8].astype(jnp.bfloat16)
    axes = jax.tree.map(lambda d: d.axes, moe_defs(moe, t.D_MODEL), is_leaf=lambda d: hasattr(d, "axes"))
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    sharded = jax.device_put(params, tree_shardings(axes, mesh, RULES))
    sharded_x = jax.device_put(x, named_sharding(("batch", "seq", "embed"), mesh, RULES))
    with use_rules(mesh, RULES), use_lowering(MEGABLOX):
        text = jax.jit(loss_and_grads(moe, params, x, MoEConfig())).lower(sharded, sharded_x).as_text()
    experts, hidden = moe.experts, moe.expert.hidden
    whole = {f"{experts}x{t.D_MODEL}x{hidden}", f"{experts}x{hidden}x{t.D_MODEL}"}  # gate/up, down
    gathered = [m for m in re.findall(r'"stablehlo.all_gather".*?-> tensor<([\dx]+)x(\w+)>', text)]
    scattered = re.findall(r'"stablehlo.reduce_scatter".*?-> tensor<([\dx]+)x(\w+)>', text, re.S)
    summed = re.findall(r'"stablehlo.all_reduce".*?-> tensor<([\dx]+)x(\w+)>', text, re.S)
    weights_gathered = [dtype for shape, dtype in gathered if shape in whole]
    assert len(weights_gathered) == 3 and set(weights_gathered) == {"bf16"}, gathered
    shard = {f"{experts}x{t.D_MODEL // 8}x{hidden}", f"{experts}x{hidden}x{t.D_MODEL // 8}"}
    weights_scattered = [dtype for shape, dtype in scattered if shape in shard]
    assert len(weights_scattered) == 3 and set(weights_scattered) == {"bf16"}, scattered
    assert not [s for s in summed if s[0] in whole], summed
    print("moe weight gather ok")


if __name__ == "__main__":
    main()
