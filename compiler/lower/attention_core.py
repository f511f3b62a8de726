"""The one attention core: training, prefill and decode all call `attend`.

Which keys a query sees is decided by positions, not by array indices: a key is visible when
it is not in the query's future, lies inside the sliding window and the same chunk, and (for a
packed training sequence) belongs to the same document: segment ids name each token's document,
and positions restart at 0 where a document starts, so windows and chunks count from each
document's start. A KV cache's empty slots carry the position EMPTY_SLOT, which is in every
query's future, so a cache of any length needs no separate length mask. `impl` picks the
implementation; "xla" (einsum, softmax in float32) runs everywhere and is the numerical reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.sharding import constrain

EMPTY_SLOT = 2**30  # position of a cache slot that holds no key yet


def visible(q_positions: jax.Array, kv_positions: jax.Array, *, window: int | None = None,
            chunk: int | None = None, segment_ids: jax.Array | None = None,
            image_blocks: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """[batch, seq, kv_seq] booleans: may the query at q_positions see the key at kv_positions?
    segment_ids [batch, seq] (queries and keys the same tokens) keeps each to its own document.
    image_blocks ([batch, seq], [batch, kv_seq]): the image each query and key belongs to (-1 for
    text); a query also sees the later keys of its own image (Gemma 3), window and chunk still apply."""
    q = q_positions[:, :, None]
    k = kv_positions[:, None, :]
    mask = k <= q
    if image_blocks is not None:
        q_block, kv_block = image_blocks[0][:, :, None], image_blocks[1][:, None, :]
        mask |= (q_block == kv_block) & (q_block >= 0)
    if segment_ids is not None:
        # Positions restart in every document, so a later document's keys can have positions
        # below the query's: only the segment test keeps them out.
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if window is not None:
        # The window counts the query itself: it sees keys at q - window + 1 ... q (HF and Mistral).
        mask &= k > q - window
    if chunk is not None:
        mask &= (k // chunk) == (q // chunk)
    return mask


def _attend_xla(q, k, v, *, q_positions, kv_positions, scale, window, chunk, softcap, sinks, segment_ids,
                image_blocks=None):
    mask = visible(q_positions, kv_positions, window=window, chunk=chunk, segment_ids=segment_ids,
                   image_blocks=image_blocks)
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    # Query heads that share a key/value head sit next to each other (HF's repeat_kv order).
    q = q.reshape(batch, seq, kv_heads, groups, head_dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        # A learned logit per head joins the softmax's denominator and then is dropped (GPT-OSS).
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1),
                                (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, seq, heads, v.shape[-1]).astype(v.dtype)


# Every implementation takes attend's arguments (less `impl`); a kernel path registers here.
IMPLEMENTATIONS = {"xla": _attend_xla}


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array, kv_positions: jax.Array,
           scale: float, window: int | None = None, chunk: int | None = None,
           softcap: float | None = None, sinks: jax.Array | None = None,
           segment_ids: jax.Array | None = None, image_blocks: tuple | None = None,
           impl: str = "xla") -> jax.Array:
    """Causal attention (and bidirectional within an image: image_blocks, see `visible`).

    q [batch, seq, heads, head_dim]; k [batch, kv_seq, kv_heads, head_dim]; v [batch, kv_seq,
    kv_heads, value_dim], where value_dim may differ from head_dim (MLA);
    q_positions [batch, seq] and kv_positions [batch, kv_seq] int32; sinks [heads] or None;
    segment_ids [batch, seq] int32 for self-attention over a packed sequence (seq == kv_seq, each
    document's positions counting from 0), None for one document per row (and with a KV cache).
    Returns [batch, seq, heads, value_dim] in v's dtype.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation '{impl}'; have: {', '.join(IMPLEMENTATIONS)}")
    if segment_ids is not None and not (segment_ids.shape == q.shape[:2] and q.shape[1] == k.shape[1]):
        raise ValueError(f"segment ids {segment_ids.shape} are for self-attention over one packed sequence; "
                         f"got {q.shape[1]} queries against {k.shape[1]} keys")
    value_dim = v.shape[-1]
    if impl != "xla" and value_dim != q.shape[-1]:
        q, k, v = _equal_head_dims(q, k, v)
    blocks = {} if image_blocks is None else {"image_blocks": image_blocks}
    if blocks and impl != "xla":
        raise ValueError(f"image blocks (bidirectional image attention) run on the xla implementation, not '{impl}'")
    out = IMPLEMENTATIONS[impl](q, k, v, q_positions=q_positions, kv_positions=kv_positions, scale=scale,
                                window=window, chunk=chunk, softcap=softcap, sinks=sinks,
                                segment_ids=segment_ids, **blocks)
    return constrain(out[..., :value_dim], ("batch", "seq", "heads", "head_dim"))


def _equal_head_dims(q, k, v):
    """Zero-pad to one head size for kernels that need it: zeros added to q and k leave the scores
    unchanged, and zeros added to v only add output columns, which `attend` cuts off again."""
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    return pad(q), pad(k), pad(v)
