"""Whether projections of the same input run as one matmul over their stacked kernels.

On TPUs XLA then generates one kernel where it would generate two or three, forward and
backward, and the larger matmul suits the MXUs: compiles take less CPU time and memory. Joining
the query to keys and values as well, where no mesh axis splits heads, saves one all-gather and
one gradient operand per layer. On CPUs the stacked copy of the weights costs more than the shared
matmul saves, so there the projections stay apart. The results are the same either way
(docs/compile.md has the measurements).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mxc.compiler.lower.choices import lowering_choices, use_lowering
from mxc.compiler.lower.projection import weight
from mxc.compiler.lower.sharding import active_rules, partition_spec


def stacked_projections() -> bool:
    """The plan's choice (compiler/lower/choices.py: stacked for TPUs)."""
    return lowering_choices().stacked_projections


def force_stacked_projections(value: bool):
    """A context with the choice set either way (tests compare the two programs)."""
    return use_lowering(dataclasses.replace(lowering_choices(), stacked_projections=value))


def project_pair(x, first: dict, second: dict, dtype, pattern: str, mlp: bool = False) -> tuple:
    """Two projections of x from one matmul over their kernels (the same shape) stacked on a new
    axis 1, which keeps each kernel's sharding. `pattern` is the einsum with that axis named in the
    kernel and leading the output, e.g. "bse,ekhd->kbshd"; each projection's bias is added.
    Quantized kernels are dequantized first (projection.weight; `mlp`: the feed-forward's)."""
    kernel = jnp.stack([weight(first, dtype, mlp=mlp), weight(second, dtype, mlp=mlp)], axis=1)
    return _with_biases(jnp.einsum(pattern, x, kernel), (first, second), dtype)


def heads_unsplit() -> bool:
    """True unless a mesh axis splits attention heads: joined along the heads axis, the query's
    and the keys' shards would no longer line up with their heads."""
    active = active_rules()
    if active is None:
        return True
    mesh, rules = active
    return all(partition_spec((axis,), rules, mesh)[0] is None for axis in ("heads", "kv_heads"))


def project_joined(x, projections: list[dict], dtype, pattern: str) -> tuple:
    """Projections of x from one matmul over their kernels joined along axis 1, where their
    shapes may differ (the heads of [embed, heads, head_dim]); `pattern` puts that axis third in
    the output, e.g. "bse,ehd->bshd". Each projection's bias is added to its part."""
    kernel = jnp.concatenate([weight(p, dtype) for p in projections], axis=1)
    joined = jnp.einsum(pattern, x, kernel)
    parts = jnp.split(joined, np.cumsum([p["kernel"].shape[1] for p in projections])[:-1], axis=2)
    return _with_biases(parts, projections, dtype)


def _with_biases(outputs, projections, dtype) -> tuple:
    return tuple(y + p["bias"].astype(dtype) if "bias" in p else y for y, p in zip(outputs, projections))
