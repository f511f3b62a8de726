"""Logical axes to mesh axes. Layer code names logical axes only; the plan's rules map them.

Rules are active inside `use_rules(mesh, rules)`; outside it `constrain` is the identity, so the
same layer code runs unsharded on one device and sharded under a plan.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The residual stream between layers. Its sequence dimension has a logical axis of its own, so a
# plan may split it over tensor as well as context (sequence parallelism: the layer all-gathers
# it before attention and the MLP and reduce-scatters their outputs, instead of all-reducing).
RESIDUAL_AXES = ("batch", "residual_seq", "embed")
# Activation dimensions kept whole on a mesh axis that does not divide them (a decode step's one
# token under sequence parallelism), rather than padded onto every device of the axis.
WHOLE_WHEN_UNEVEN = frozenset({"residual_seq"})

Rules = Mapping[str, Sequence[str]]  # logical axis -> mesh axes, e.g. {"batch": ("data", "fsdp")}
LogicalAxes = tuple  # one logical axis name (or None) per array dimension

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("mxc_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    token = _ACTIVE.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def partition_spec(axes: LogicalAxes, rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes. A mesh axis is used at most once per
    array: a later dimension that maps to an axis already taken stays replicated there."""
    taken: set[str] = set()
    out = []
    for axis in axes:
        mesh_axes = [] if axis is None else [m for m in rules.get(axis, ()) if m not in taken]
        if mesh is not None:
            mesh_axes = [m for m in mesh_axes if m in mesh.shape and mesh.shape[m] > 1]
        taken.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*out)


def named_sharding(axes: LogicalAxes, mesh: Mesh, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, rules, mesh))


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Pin an activation's layout by its logical axes (identity when no rules are active)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = partition_spec(axes, rules, mesh)
    if WHOLE_WHEN_UNEVEN.intersection(axes):
        spec = PartitionSpec(*(None if axis in WHOLE_WHEN_UNEVEN and entry is not None
                               and size % _count(entry, mesh) else entry
                               for axis, entry, size in zip(axes, tuple(spec) + (None,) * len(axes), x.shape)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _count(entry, mesh: Mesh) -> int:
    names = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[name] for name in names)


def tree_shardings(axes_tree, mesh: Mesh, rules: Rules):
    """NamedShardings for a pytree of logical-axes tuples (e.g. the parameters' axes)."""
    return jax.tree.map(lambda axes: named_sharding(axes, mesh, rules), axes_tree,
                        is_leaf=lambda a: isinstance(a, tuple))


def active_rules() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing `use_rules`, or None: for code that must shard by hand
    (shard_map around a Pallas kernel, which XLA cannot partition by itself)."""
    return _ACTIVE.get()


def pieces(axes: LogicalAxes, dim: int) -> int:
    """How many pieces the active rules split dimension `dim` of an array with these logical axes
    into (1 outside `use_rules`)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules = active
    spec = tuple(partition_spec(axes, rules, mesh))
    entry = spec[dim] if dim < len(spec) else None
    return 1 if entry is None else _count(entry, mesh)
