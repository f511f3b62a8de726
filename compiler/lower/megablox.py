"""The dropless expert path with megablox's grouped matmul, the Pallas TPU kernel shipped with JAX
(jax.experimental.pallas.ops.tpu.megablox), in place of jax.lax.ragged_dot.

Why: XLA's TPU backend lowers ragged_dot to one dense matmul over every expert, masked (seen in
the compiled HLO with jax 0.10.2 and libtpu 0.0.52: a [experts, rows, out] convolution and a
select), so "dropless" would cost experts / top_k times its FLOPs there; megablox computes each
row with its own expert only. On other platforms the kernel runs in Pallas' interpreter, which is
how the tests check it on CPU.

A Pallas kernel is not partitioned by XLA, so under sharding rules moe.py runs the routed part in
a shard_map manual over every mesh axis. Each device routes its batch shard's tokens, sorts them
by expert and runs its own slice of the experts (the kernel's group_offset) over its slice of the
hidden units; one sum over the expert and mlp mesh axes then adds the partial outputs. A mesh
axis that splits both the batch and the experts first gathers the tokens it splits, and
scatters the summed outputs back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.expert_rows import expert_ffn, sort_assignments
from mxc.compiler.lower.projection import weight
from mxc.spec.ir import MoE

ROW_TILE = 128  # rows per kernel tile; the sorted rows are padded to a multiple of it
LANE = 128  # TPU lane width: a tile's minor dimension is a multiple of it, or the whole dimension


def _tile(size: int, largest: int = 512) -> int:
    """The largest multiple of LANE (at most `largest`) that divides size; else size itself."""
    for tile in range(largest, LANE - 1, -LANE):
        if size % tile == 0:
            return tile
    return size


def grouped_matmul(rows: jax.Array, kernel: jax.Array, group_sizes: jax.Array, first_group: jax.Array,
                   interpret: bool) -> jax.Array:
    """rows [m, k] sorted by group, kernel [local groups, k, n] holding groups first_group, ...;
    group_sizes [all groups]. Rows of other groups come back as zeros."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

    m, k = rows.shape
    n = kernel.shape[-1]
    padded = -(-m // ROW_TILE) * ROW_TILE
    rows = jnp.pad(rows, ((0, padded - m), (0, 0)))
    out = ops.gmm(rows, kernel, group_sizes, rows.dtype, (ROW_TILE, _tile(k), _tile(n)),
                  first_group.astype(jnp.int32), None, False, interpret)[:m]
    local = jnp.cumsum(group_sizes)
    start = jnp.where(first_group > 0, local[first_group - 1], 0)
    end = local[first_group + kernel.shape[0] - 1]
    index = jnp.arange(m)
    return jnp.where(((index >= start) & (index < end))[:, None], out, 0)


def dropless_rows(moe: MoE, params: dict, x: jax.Array, experts: jax.Array, weights: jax.Array,
                  first_expert: jax.Array, first_of_hidden: jax.Array, interpret: bool) -> jax.Array:
    """moe._dropless_rows with the kernel, on the experts first_expert ... of `params` (all of
    them on one device); the rows of other devices' experts contribute zeros. With the hidden
    units split over devices, only the first slice's device adds the down projection's bias."""
    dtype = x.dtype
    local_experts = params["up"]["kernel"].shape[0]
    sorted_rows = sort_assignments(moe, x, experts, weights)
    local = sorted_rows.experts - first_expert
    is_local = (local >= 0) & (local < local_experts)
    local = jnp.clip(local, 0, local_experts - 1)

    def project(name, inputs):
        y = grouped_matmul(inputs, weight(params[name], dtype, mlp=True, contracting=(1,)), sorted_rows.group_sizes,
                           first_expert, interpret)
        if "bias" in params[name]:
            here = is_local & first_of_hidden if name == "down" else is_local
            y = y + jnp.where(here[:, None], params[name]["bias"].astype(dtype)[local], 0)
        return y

    return expert_ffn(moe, params, sorted_rows, experts.shape[0], project)
