"""Dropless expert parallelism: each device's tokens travel to the devices that hold their experts.

    dispatch_experts(moe, params, x, experts, weights, plan) -> [tokens, embed]

Runs inside a shard_map that is manual over the expert mesh axes. Every device routes its own
tokens, sorts its own assignments by expert (which groups them by destination device, since a
device holds a contiguous block of experts), and sends each destination its rows with one
ragged all-to-all over the expert axes. The receiver groups what arrived by its local expert (a
local sort: nothing sorts the global batch), runs the experts' feed-forward as grouped matmuls,
and a second ragged all-to-all brings the outputs back to the rows they came from, in the
sender's sorted order, where the routing weights combine them.

Each receiver keeps a buffer with room for every assignment of every sender (a device may
receive all of them): dropless with static shapes. Sender s's rows land at s * assignments.

The plan's lowering choices (choices.py) pick the platform's pieces: on TPU the collective is
jax.lax.ragged_all_to_all and the grouped matmul megablox's kernel (megablox.py; XLA's TPU
backend runs ragged_dot as a masked matmul over every local expert). Elsewhere (XLA:CPU has no
ragged all-to-all) the same exchange runs as a dense all-to-all with a slot per destination as
large as the sender's assignments, then scattered to the same offsets, and the grouped matmul is
jax.lax.ragged_dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.lower.choices import lowering_choices
from mxc.compiler.lower.expert_rows import grouped_matmul, sort_assignments
from mxc.compiler.lower.ffn import hidden_activation
from mxc.compiler.lower.projection import weight
from mxc.spec.ir import MoE


@dataclass(frozen=True)
class DispatchPlan:
    expert_axes: tuple[str, ...]  # the mesh axes the experts are split over (row-major order)
    shards: int  # devices along them
    hidden_axes: tuple[str, ...]  # mesh axes splitting the experts' hidden units (summed after `down`)
    shard_index: jax.Array  # this device's position along expert_axes


def _all_to_all(values: jax.Array, plan: DispatchPlan) -> jax.Array:
    """[shards, ...] -> [shards, ...]: slot j goes to device j; slot s of the result came from s."""
    return jax.lax.all_to_all(values, plan.expert_axes, 0, 0, tiled=True)


def _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, plan: DispatchPlan):
    """jax.lax.ragged_all_to_all's contract (one slice per destination): operand rows
    input_offsets[j] ... + send_sizes[j] are written on device j at output_offsets[j] of its
    `output`; recv_sizes[s] rows arrive from s."""
    if lowering_choices().ragged_all_to_all:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=plan.expert_axes)
    rows = operand.shape[0]
    slot = jnp.arange(rows)
    used = slot[None, :] < send_sizes[:, None]  # [shards, rows]
    take = jnp.where(used, input_offsets[:, None] + slot[None, :], 0)
    received = _all_to_all(jnp.where(used[..., None], operand[take], 0), plan)
    offsets = _all_to_all(output_offsets, plan)  # where each sender's rows go here
    arrived = slot[None, :] < recv_sizes[:, None]
    # Rows past what a sender sent go out of range and are dropped by the scatter.
    target = jnp.where(arrived, offsets[:, None] + slot[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


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
        return jnp.where(valid[:, None], grouped_matmul(inputs, kernel, group_sizes), 0)

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
    # Rows per destination and local expert: sent, then as received from each sender.
    counts = sorted_rows.group_sizes.reshape(plan.shards, local_experts)
    send_sizes = counts.sum(axis=1)
    starts = jnp.cumsum(send_sizes) - send_sizes
    arrived_counts = _all_to_all(counts, plan)  # [senders, local experts]
    recv_sizes = arrived_counts.sum(axis=1)
    here = jnp.full((plan.shards,), plan.shard_index * assignments, jnp.int32)
    received = _exchange(sorted_rows.rows, jnp.zeros((plan.shards * assignments, x.shape[-1]), x.dtype),
                         starts, send_sizes, here, recv_sizes, plan)

    # Each sender's rows arrive sorted by expert: slot i of sender s's block holds the local
    # expert whose running count passes i (local_experts where nothing arrived).
    slot = jnp.arange(assignments)
    ends = jnp.cumsum(arrived_counts, axis=1)  # [senders, local experts]
    ids = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1).astype(jnp.int32)  # [senders, slots]
    out = _local_ffn(moe, params, received, ids.reshape(-1), plan)

    # Back: block s goes to sender s, at the offset its rows for this device started from.
    origin = _all_to_all(starts, plan)
    blocks = jnp.arange(plan.shards, dtype=jnp.int32) * assignments
    out_sorted = _exchange(out, jnp.zeros((assignments, out.shape[-1]), out.dtype), blocks, recv_sizes, origin,
                           send_sizes, plan)
    if moe.router.weight_on != "input":
        out_sorted = out_sorted * sorted_rows.weights
    unsorted = out_sorted[jnp.argsort(sorted_rows.order)]
    return unsorted.reshape(experts.shape[0], -1, out_sorted.shape[-1]).sum(axis=1)
