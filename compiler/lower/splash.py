"""Attention on TPU targets: JAX's splash-attention Pallas kernels.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) is a block-sparse flash
attention: it walks the score matrix in [block_q, block_kv] tiles, skips tiles the mask empties,
and keeps only running softmax statistics, so a sequence of 8192 never materialises its
8192² scores. Its masks are static (numpy-computable), which fits training and prefill: queries
and keys are the same tokens of one sequence. Decoding against a KV cache takes the XLA path.

Packed sequences. The kernel's segment ids keep each document's queries on its own keys; its
static masks go by index, which within one document differs from the restarted positions by a
constant, so causality and the sliding window come out as the XLA path's. Chunks do not: they
count from each document's start. With segment ids, the chunk therefore enters as part of the
segment id (document and chunk of position // chunk) on a causal mask, which gives the XLA path's
mask exactly but lets the kernel skip only the tiles causality empties.

Mapping of mxc's attention options onto the kernel:
    causal                      CausalMask
    window (query's own counted) LocalMask(window_size=(window - 1, 0)), causal on the right
    chunk (Llama 4)             ChunkedCausalMask; with segment ids, chunk ids inside them
    segment ids                 the kernel's SegmentIds (queries and keys the same tokens)
    softcap (Gemma 2)           attn_logits_soft_cap, applied to the already scaled scores
    sinks (GPT-OSS)             the kernel's per-head sinks
    scale                       folded into q (the kernel does not scale)
    GQA / MQA                   the MHA kernel groups query heads onto kv heads itself

Under sharding rules the kernel runs inside shard_map (XLA cannot partition a Pallas call):
batch and heads are split as the rules say where they divide evenly (else that axis stays whole),
kv heads that cannot split like the query heads are repeated to match them, and the sequence
stays whole on each device (no context parallelism on this path).
On a CPU host, `interpret=True` runs the same kernel in Pallas's interpreter, which is how the
tests check its numerics against the XLA path. Importing this module registers the kernel with
attention_core as attention_impl "splash" (and "splash_interpret").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from mxc.compiler.lower.attention_core import IMPLEMENTATIONS
from mxc.compiler.lower.sharding import active_rules, partition_spec

# Kernel tiles: multiples of 128 (the TPU lane width); 512 is what MaxText ships as its default.
_BLOCK_CHOICES = (512, 256, 128)


def _block(length: int) -> int:
    for size in _BLOCK_CHOICES:
        if length % size == 0:
            return size
    raise ValueError(f"splash attention needs a sequence length divisible by 128, got {length}; "
                     "use attention_impl='xla' for this shape")


def attention_impl_for(platform: str, seq: int) -> str:
    """The attention path a target gets: the splash kernel on TPU where the sequence tiles into
    128-token blocks; otherwise XLA's einsum path (CPU, GPU, odd lengths), the numerical reference."""
    return "splash" if platform == "tpu" and seq % _BLOCK_CHOICES[-1] == 0 else "xla"


def attention_mask(q_len: int, kv_len: int, *, window: int | None = None,
                   chunk: int | None = None) -> masks.Mask:
    """The kernel's lazy mask for one head: causal, narrowed by a sliding window or chunks."""
    shape = (q_len, kv_len)
    mask = masks.CausalMask(shape)
    if window is not None:
        mask = masks.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    if chunk is not None:
        chunked = masks.ChunkedCausalMask(shape, chunk_size=chunk)
        mask = chunked if window is None else masks.LogicalAnd(mask, chunked)
    return mask


def make_kernel(heads: int, q_len: int, kv_len: int, *, window: int | None = None,
                chunk: int | None = None, softcap: float | None = None, interpret: bool = False):
    """A splash kernel for [heads, q_len, head_dim] queries and [kv_heads, kv_len, head_dim] keys."""
    block_q, block_kv = _block(q_len), _block(kv_len)
    block_sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv)
    head_mask = attention_mask(q_len, kv_len, window=window, chunk=chunk)
    return splash.make_splash_mha(masks.MultiHeadMask([head_mask] * heads), block_sizes=block_sizes,
                                  attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _attend_local(q, k, v, sinks, segments, *, scale, window, chunk, softcap, interpret):
    """Unsharded: q [batch, seq, heads, head_dim], k/v [batch, seq, kv_heads, head_dim];
    segments [batch, seq] or None (chunks, if any, already folded into them)."""
    kernel = make_kernel(q.shape[2], q.shape[1], k.shape[1], window=window,
                         chunk=chunk if segments is None else None, softcap=softcap, interpret=interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # the kernel wants [heads, seq, head_dim]
    q = heads_first(q * jnp.asarray(scale, q.dtype))
    k, v = heads_first(k), heads_first(v)

    def one_row(q1, k1, v1, s1):
        ids = None if s1 is None else splash.SegmentIds(q=s1, kv=s1)
        return kernel(q1, k1, v1, segment_ids=ids, sinks=sinks)

    if segments is None:
        out = jax.vmap(lambda q1, k1, v1: one_row(q1, k1, v1, None))(q, k, v)
    else:
        out = jax.vmap(one_row)(q, k, v, segments)
    return heads_first(out)


def _kernel_segments(segment_ids, positions, chunk: int | None):
    """The segment ids the kernel gets: the documents', with each document's chunk (counted from
    its own start, as the XLA path's positions do) folded in when the layer is chunked."""
    segment_ids = segment_ids.astype(jnp.int32)
    if chunk is None:
        return segment_ids
    chunks_per_row = positions.shape[1] // chunk + 1  # positions stay below the row's length
    return segment_ids * chunks_per_row + positions.astype(jnp.int32) // chunk


def splash_attend(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions=None, kv_positions=None,
                  window: int | None = None, chunk: int | None = None, softcap: float | None = None,
                  sinks: jax.Array | None = None, segment_ids: jax.Array | None = None, scale: float,
                  interpret: bool = False) -> jax.Array:
    """Causal self-attention over a whole sequence with the splash kernel; the XLA `attend`'s
    signature, so the model picks either by name.

    q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim(v)]; sinks [heads] or
    None; segment_ids [batch, seq] or None. Without segment ids the positions are those of the
    sequence itself (0..seq-1) by this path's contract, and are not read: the masks are built for
    them statically. With segment ids, positions restart in each document, and are read only to
    place a chunked layer's chunks."""
    del kv_positions  # the same tokens as the queries': self-attention only
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"splash attention is for self-attention over one sequence; got {q.shape[1]} "
                         f"queries against {k.shape[1]} keys (decode with attention_impl='xla')")
    segments = None if segment_ids is None else _kernel_segments(segment_ids, q_positions, chunk)
    options = dict(scale=scale, window=window, chunk=chunk, softcap=softcap, interpret=interpret)
    active = active_rules()
    if active is None:
        return _attend_local(q, k, v, sinks, segments, **options)

    mesh, rules = active
    q_spec = partition_spec(("batch", None, "heads", None), rules, mesh)
    kv_spec = partition_spec(("batch", None, "kv_heads", None), rules, mesh)
    batch_axes = _dividing(q_spec[0], q.shape[0], mesh)
    head_axes = _dividing(q_spec[2], q.shape[2], mesh)
    kv_head_axes = _dividing(kv_spec[2], k.shape[2], mesh)
    if kv_head_axes != head_axes:
        # kv heads split unlike query heads (e.g. fewer kv heads than tensor shards): give every
        # query head its own copy of its kv head, so each shard holds the pairs it needs.
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    spec = PartitionSpec(batch_axes, None, head_axes, None)
    # shard_map takes arrays only: the optional sinks and segments join the arguments when present.
    extras = {name: (value, value_spec) for name, value, value_spec in (
        ("sinks", sinks, PartitionSpec(head_axes)), ("segments", segments, PartitionSpec(batch_axes, None)))
        if value is not None}

    def local(q1, k1, v1, *given):
        named = dict(zip(extras, given))
        return _attend_local(q1, k1, v1, named.get("sinks"), named.get("segments"), **options)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, *(s for _, s in extras.values())),
                         out_specs=spec, check_vma=False)(q, k, v, *(a for a, _ in extras.values()))


def _dividing(mesh_axes, size: int, mesh):
    """`mesh_axes` (one PartitionSpec entry) if they split `size` evenly, else None (replicated):
    shard_map needs even blocks, and a batch of one or two kv heads may not split."""
    if mesh_axes is None:
        return None
    names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    shards = 1
    for name in names:
        shards *= mesh.shape[name]
    return mesh_axes if size % shards == 0 else None


# attention_impl="splash" for TPU targets; "splash_interpret" runs the same kernel anywhere
# (slowly, in Pallas's interpreter), which is how CPU tests compare it with the XLA path.
IMPLEMENTATIONS["splash"] = splash_attend
IMPLEMENTATIONS["splash_interpret"] = functools.partial(splash_attend, interpret=True)
