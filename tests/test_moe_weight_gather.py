"""What the dropless expert weights cost in memory: the weights enter the batch shards' region
as their stored shards and are gathered there in the compute dtype, so that their gradient is
reduce-scattered, not all-reduced whole in float32 (tests/children/moe_weight_gather.py, 8
virtual CPU devices); megablox's row masks are left out where every row belongs to a group."""

from __future__ import annotations

import os
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from mxc.compiler.lower import megablox
from runtime_support import child, cpu_env


def test_expert_weights_are_gathered_in_bfloat16_and_their_gradients_reduce_scattered():
    here = os.path.dirname(os.path.abspath(__file__))
    env = cpu_env(8, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(child("moe_weight_gather"), capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "moe weight gather ok" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


def _selects(every_row_grouped: bool) -> int:
    rows, kernel = jnp.ones((256, 128), jnp.bfloat16), jnp.ones((4, 128, 128), jnp.bfloat16)
    sizes = jnp.array([64, 64, 64, 64], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda r, k, g: megablox.grouped_matmul(
        r, k, g, jnp.zeros((), jnp.int32), True, every_row_grouped))(rows, kernel, sizes)
    return sum(e.primitive.name == "select_n" for e in jaxpr.jaxpr.eqns)


def test_megablox_masks_rows_only_where_some_may_lie_outside_the_groups():
    assert _selects(every_row_grouped=False) == 2  # the rows in, the product out
    assert _selects(every_row_grouped=True) == 0
