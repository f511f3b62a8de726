"""Causal self-attention in query blocks: each block of queries attends only to the keys up to its
own end, so the scores above the diagonal's blocks are never computed (CPU plans' training and
evaluation steps; LoweringChoices.causal_query_blocks).

A self-attention over seq tokens cut into n query blocks computes (n + 1) / (2n) of the full
[seq, seq] scores (5/8 for 4 blocks): the blocks' keys end where the block ends, and the key
mask (`attention_core.visible`: positions, documents, windows, chunks) still applies inside them.
Skipping the keys after a block's end by index assumes that no query sees a key after it in the
row, which holds for every batch the runtime builds (positions count up inside each document,
segment ids keep documents apart) and is what splash attention's causal mask assumes on TPUs;
bidirectional image blocks break it, so they keep the one-block core.

The query heads that share a key/value head are one [groups * block, head_dim] matrix per (row,
kv head), laid out [batch, kv_heads, ...] before the products: XLA:CPU's products and softmax over
the [batch, seq, kv_heads, groups, ...] layout of the one-block core wrote transposed copies of
the score-sized arrays (docs/runtime.md, "Attention in query blocks"). The softmax is the
one-block core's (float32, the scale on the scores), so values agree with it to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.compiler.lower.attention_core import IMPLEMENTATIONS, visible

IMPL = "xla_query_blocks"  # its name among attention_core's implementations


def query_blocks(seq: int, wanted: int) -> int:
    """The most blocks, at most `wanted`, that cut seq into equal parts."""
    return next(n for n in range(max(1, min(wanted, seq)), 0, -1) if seq % n == 0)


def _block(q, k, v, mask, scale, softcap, sinks):
    """q [b, kv, g, s, d] against k, v [b, kv, t, d] with mask [b, s, t] -> [b, kv, g, s, dv] float32."""
    b, kv, g, s, d = q.shape
    scores = jnp.einsum("bkqd,bktd->bkqt", q.reshape(b, kv, g * s, d), k,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g, s, mask.shape[-1])).reshape(b, 1, g * s, -1)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        # A learned logit per head joins the softmax's denominator and then is dropped (GPT-OSS).
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, g, 1, 1), (b, kv, g, s, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink.reshape(b, kv, g * s, 1)], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkqt,bktd->bkqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, kv, g, s, v.shape[-1])


def attend_in_query_blocks(q, k, v, *, q_positions, kv_positions, scale, window, chunk, softcap, sinks,
                           segment_ids, blocks: int = 4):
    """attention_core.attend's "xla" core over self-attention (q and k the same tokens) in
    `blocks` query blocks (fewer where seq does not divide)."""
    mask = visible(q_positions, kv_positions, window=window, chunk=chunk, segment_ids=segment_ids)
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    # Query heads that share a key/value head sit next to each other (HF's repeat_kv order).
    q = jnp.transpose(q.reshape(batch, seq, kv_heads, groups, head_dim), (0, 2, 3, 1, 4))
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    n = query_blocks(seq, blocks)
    size = seq // n
    outs = [_block(q[:, :, :, i * size:(i + 1) * size], k[:, :, :(i + 1) * size], v[:, :, :(i + 1) * size],
                   mask[:, i * size:(i + 1) * size, :(i + 1) * size], scale, softcap, sinks) for i in range(n)]
    out = jnp.concatenate(outs, axis=3)  # [batch, kv_heads, groups, seq, value_dim]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, seq, heads, v.shape[-1]).astype(v.dtype)


def _registered(q, k, v, *, q_positions, kv_positions, scale, window, chunk, softcap, sinks, segment_ids):
    from mxc.compiler.lower.choices import lowering_choices

    if q.shape[1] != k.shape[1]:
        raise ValueError(f"{IMPL} is self-attention: {q.shape[1]} queries against {k.shape[1]} keys")
    return attend_in_query_blocks(q, k, v, q_positions=q_positions, kv_positions=kv_positions, scale=scale,
                                  window=window, chunk=chunk, softcap=softcap, sinks=sinks,
                                  segment_ids=segment_ids, blocks=lowering_choices().causal_query_blocks)


IMPLEMENTATIONS[IMPL] = _registered


def self_attention_impl(impl: str, *, cached: bool, image_blocks) -> str:
    """The implementation a layer's attention runs: query blocks where the plan chose them
    (CPU plans) for the XLA core over a sequence's own keys, else `impl` as given."""
    from mxc.compiler.lower.choices import lowering_choices

    if impl != "xla" or cached or image_blocks is not None or lowering_choices().causal_query_blocks <= 1:
        return impl
    return IMPL
