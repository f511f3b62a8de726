"""Dropless expert parallelism: each device's tokens travel to the devices that hold their experts.

    dispatch_experts(moe, params, x, experts, weights, plan) -> [tokens, embed]

Runs inside a shard_map that is manual over the expert mesh axes. Every device routes its own
tokens, sorts its own assignments by expert (which groups them by destination device, since a
device holds a contiguous block of experts), and sends each destination its rows with one
all-to-all over the expert axes. The receiver sorts what arrived by its local expert id (again a
local sort: nothing sorts the global batch), runs the experts' feed-forward as grouped matmuls
(jax.lax.ragged_dot), and a second all-to-all brings the outputs back to the tokens' devices, where the routing weights
combine them.

The all-to-all is dense: each destination gets a buffer with room for every assignment of the
sender (a device may route all of its tokens to one device), the unused rows zero and marked by
an out-of-range expert id. That makes it dropless with static shapes on every platform, at the
cost of `shards` times the assignment rows in the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.lower.expert_rows import sort_assignments
from mxc.compiler.lower.ffn import hidden_activation
from mxc.compiler.lower.projection import weight
from mxc.spec.ir import MoE


@dataclass(frozen=True)
class DispatchPlan:
    expert_axes: tuple[str, ...]  # the mesh axes the experts are split over (row-major order)
    shards: int  # devices along them
    hidden_axes: tuple[str, ...]  # mesh axes splitting the experts' hidden units (summed after `down`)


def _exchange(buffer: jax.Array, plan: DispatchPlan) -> jax.Array:
    """[shards, ...] -> [shards, ...]: slot j goes to device j; slot s of the result came from s."""
    return jax.lax.all_to_all(buffer, plan.expert_axes, 0, 0, tiled=True)


def _local_ffn(moe: MoE, params: dict, rows: jax.Array, ids: jax.Array, plan: DispatchPlan) -> jax.Array:
    """rows [n, embed] with their local expert ids [n] (local_experts marks an empty slot) ->
    each row through its expert's feed-forward, empty slots zero."""
    dtype = rows.dtype
    local_experts = params["up"]["kernel"].shape[0]
    order = jnp.argsort(ids)  # stable; empty slots sort last
    grouped = rows[order]
    grouped_ids = ids[order]
    valid = grouped_ids < local_experts
    group_sizes = jnp.bincount(ids, length=local_experts).astype(jnp.int32)
    bias_index = jnp.clip(grouped_ids, 0, local_experts - 1)

    def matmul(name, inputs):
        kernel = weight(params[name], dtype, mlp=True, contracting=(1,))
        return jnp.where(valid[:, None], jax.lax.ragged_dot(inputs, kernel, group_sizes), 0)

    def project(name, inputs):
        y = matmul(name, inputs)
        if "bias" in params[name]:
            y = y + jnp.where(valid[:, None], params[name]["bias"].astype(dtype)[bias_index], 0)
        return y

    gate = checkpoint_name(project("gate", grouped), "mlpwi") if "gate" in params else None
    hidden = hidden_activation(moe.expert, gate, checkpoint_name(project("up", grouped), "mlpwi"))
    out = matmul("down", hidden)
    if plan.hidden_axes:
        out = jax.lax.psum(out, plan.hidden_axes)  # partial sums over the split hidden units
    if "bias" in params["down"]:
        out = out + jnp.where(valid[:, None], params["down"]["bias"].astype(dtype)[bias_index], 0)
    return out[jnp.argsort(order)]  # back to arrival order


def dispatch_experts(moe: MoE, params: dict, x: jax.Array, experts: jax.Array, weights: jax.Array,
                     plan: DispatchPlan) -> jax.Array:
    """x [tokens, embed] (this device's), experts and weights [tokens, top_k] (global expert ids);
    params the experts this device holds, [experts / shards, ...]. Returns [tokens, embed]."""
    local_experts = params["up"]["kernel"].shape[0]
    sorted_rows = sort_assignments(moe, x, experts, weights)
    assignments = sorted_rows.rows.shape[0]
    destination = sorted_rows.experts // local_experts
    send_counts = sorted_rows.group_sizes.reshape(plan.shards, local_experts).sum(axis=1)
    starts = jnp.cumsum(send_counts) - send_counts
    slot = jnp.arange(assignments)
    used = slot[None, :] < send_counts[:, None]  # [shards, assignments]
    take = jnp.where(used, starts[:, None] + slot[None, :], 0)
    send_rows = jnp.where(used[..., None], sorted_rows.rows[take], 0)
    send_ids = jnp.where(used, (sorted_rows.experts % local_experts)[take], local_experts)

    received_rows = _exchange(send_rows, plan)
    received_ids = _exchange(send_ids, plan)
    out = _local_ffn(moe, params, received_rows.reshape(-1, x.shape[-1]), received_ids.reshape(-1), plan)
    returned = _exchange(out.reshape(plan.shards, assignments, -1), plan)

    # Sorted row i went to device destination[i], slot i - starts[destination[i]].
    out_sorted = returned[destination, slot - starts[destination]]
    if moe.router.weight_on != "input":
        out_sorted = out_sorted * sorted_rows.weights
    unsorted = out_sorted[jnp.argsort(sorted_rows.order)]
    return unsorted.reshape(experts.shape[0], -1, out_sorted.shape[-1]).sum(axis=1)

# Not done: megablox's kernel as the grouped matmul here (moe.py keeps megablox on its own
# layout), and jax.lax.ragged_all_to_all in place of the dense buffers where the platform has it.
