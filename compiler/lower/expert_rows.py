"""Dropless experts over sorted assignments: the sort and the grouped matmul the one-device path
(moe.py) and the expert-parallel dispatch (expert_dispatch.py) share, and the one-device path's
feed-forward over the sorted rows."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.lower import megablox
from mxc.compiler.lower.choices import lowering_choices
from mxc.compiler.lower.ffn import hidden_activation
from mxc.spec.ir import MoE


def grouped_matmul(rows: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *,
                   every_row_grouped: bool = False) -> jax.Array:
    """rows [m, k] sorted by group times each group's kernel [groups, k, n], as the lowering
    choices say: megablox's kernel (on TPU, where XLA runs ragged_dot as a masked matmul over
    every group) or jax.lax.ragged_dot. Rows past the groups come back as zeros;
    `every_row_grouped` (sum(group_sizes) == m) spares megablox's masks."""
    choices = lowering_choices()
    if choices.grouped_matmul == "megablox":
        return megablox.grouped_matmul(rows, kernel, group_sizes, jnp.zeros((), jnp.int32),
                                       choices.interpret_kernels, every_row_grouped, choices.grouped_flops_per_byte,
                                       choices.grouped_vmem_bytes)
    return jax.lax.ragged_dot(rows, kernel, group_sizes)


class SortedAssignments(NamedTuple):
    order: jax.Array  # assignment index of each sorted row
    experts: jax.Array  # expert of each sorted row
    group_sizes: jax.Array  # rows per expert, all experts
    weights: jax.Array  # router weight of each sorted row, [rows, 1]
    rows: jax.Array  # the token of each sorted row, weighted if the router weighs the input


def sort_assignments(moe: MoE, x: jax.Array, experts: jax.Array, weights: jax.Array) -> SortedAssignments:
    """x [tokens, embed] with its experts and weights [tokens, top_k], sorted by expert."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    # argsort is stable: within an expert, assignments keep token order.
    order = jnp.argsort(flat)
    sorted_weights = weights.reshape(-1)[order].astype(x.dtype)[:, None]
    rows = x[order // top_k]
    if moe.router.weight_on == "input":
        rows = rows * sorted_weights
    return SortedAssignments(order, flat[order], jnp.bincount(flat, length=moe.experts).astype(jnp.int32),
                             sorted_weights, rows)


def expert_ffn(moe: MoE, params: dict, sorted_rows: SortedAssignments, tokens: int,
               project: Callable[[str, jax.Array], jax.Array]) -> jax.Array:
    """The experts' feed-forward on the sorted rows, `project(name, inputs)` being one grouped
    matmul (with bias); then unsorted and summed per token: [tokens, embed]."""
    gate = checkpoint_name(project("gate", sorted_rows.rows), "mlpwi") if "gate" in params else None
    hidden = hidden_activation(moe.expert, gate, checkpoint_name(project("up", sorted_rows.rows), "mlpwi"))
    out = project("down", hidden)
    if moe.router.weight_on != "input":
        out = out * sorted_rows.weights
    unsorted = out[jnp.argsort(sorted_rows.order)]  # back to (token, slot) order
    return unsorted.reshape(tokens, -1, out.shape[-1]).sum(axis=1)
