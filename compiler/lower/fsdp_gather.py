"""A weight product whose weight is gathered explicitly over the mesh axes that shard it
(FSDP), so that its gradient leaves the product reduce-scattered.

    gathered_product(pattern, x, kernel, out_dtype=None) -> jnp.einsum(pattern, x, kernel)

Left to the partitioner, a scanned layer's weight gradient in an FSDP training step is
all-reduced whole over the fsdp axis and each device then slices its piece out of it. Here the
product runs in a shard_map that is manual over the axes that split the batch and the weight's
embedding dimension (data, fsdp, expert; the others, tensor, stay automatic): the kernel's shard
is all-gathered, multiplied with the device's own tokens, and in the backward pass the
transpose of that all-gather is a reduce-scatter of the device's partial weight gradient. The
kernel is marked as varying over the axes that only split the batch (data) before the gather, so
that their all-reduce runs on the scattered piece, not on the whole gradient.

The product is the same either way (values agree to float32 rounding). Where the mesh, the rules
or the shapes do not fit the form above it is the plain einsum: any choice of the gathered
dimension is correct, the form only decides the communication.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mxc.compiler.lower.sharding import active_rules, partition_spec
from mxc.compiler.lower.weight_gradients import _letters

_D_MODEL: contextvars.ContextVar[int | None] = contextvars.ContextVar("mxc_fsdp_d_model", default=None)


@contextlib.contextmanager
def model_width(d_model: int):
    """The model's d_model while its layers are traced: a kernel's dimension of that size is the
    one the rules shard over fsdp (the `embed` logical axis)."""
    token = _D_MODEL.set(d_model)
    try:
        yield
    finally:
        _D_MODEL.reset(token)


def kernel_product(pattern: str, x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    """The plan's product with a (float) kernel: gathered where it chose reduce-scattered weight
    gradients (LoweringChoices.reduce_scattered_weight_gradients), else the plain einsum."""
    from mxc.compiler.lower.choices import lowering_choices

    if lowering_choices().reduce_scattered_weight_gradients:
        return gathered_product(pattern, x, kernel, out_dtype)
    return jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _layout(pattern: str, x, kernel):
    """(mesh, batch axes, weight axes, x letters, kernel letters, out letters, the kernel's
    gathered dimension) where the product can run gathered, else None."""
    active = active_rules()
    if active is None:
        return None
    mesh, rules = active
    batch_axes = _axes(partition_spec(("batch",), rules, mesh)[0])
    weight_axes = _axes(partition_spec(("embed",), rules, mesh)[0])
    # Only axes that split the tokens too: a partial weight gradient exists over exactly those.
    if not weight_axes or not set(weight_axes) <= set(batch_axes):
        return None
    letters = _letters(pattern, x.ndim)
    if letters is None:
        return None
    x_axes, kernel_axes, out_axes = letters
    if x_axes[0] in kernel_axes or x.shape[0] % math.prod(mesh.shape[a] for a in batch_axes):
        return None
    # The embedding dimension: the kernel's dimension of d_model's size, the one the rules shard.
    d_model = _D_MODEL.get()
    shards = math.prod(mesh.shape[a] for a in weight_axes)
    candidates = [i for i, size in enumerate(kernel.shape) if size == d_model and size % shards == 0]
    if not candidates:
        return None
    return mesh, batch_axes, weight_axes, x_axes, kernel_axes, out_axes, candidates[0]


def gathered_product(pattern: str, x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    layout = _layout(pattern, x, kernel)
    if layout is None:
        return jnp.einsum(pattern, x, kernel, preferred_element_type=out_dtype)
    mesh, batch_axes, weight_axes, x_axes, kernel_axes, out_axes, dim = layout
    batch_only = tuple(a for a in batch_axes if a not in weight_axes)

    def spec(rank: int, at: int, axes) -> PartitionSpec:
        return PartitionSpec(*(axes if i == at else None for i in range(rank)))

    def local(x_block, kernel_shard):
        if batch_only:
            kernel_shard = jax.lax.pcast(kernel_shard, batch_only, to="varying")
        whole = jax.lax.all_gather(kernel_shard, weight_axes, axis=dim, tiled=True)
        return jnp.einsum(pattern, x_block, whole, preferred_element_type=out_dtype)

    return jax.shard_map(local, mesh=mesh, axis_names=set(batch_axes),
                         in_specs=(spec(x.ndim, 0, batch_axes), spec(kernel.ndim, dim, weight_axes)),
                         out_specs=spec(len(out_axes), out_axes.index(x_axes[0]), batch_axes))(x, kernel)

