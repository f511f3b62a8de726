"""Phi-3's LongRoPE while decoding across original_max_seq, as transformers' generate does it.

A LongRoPE model rotates with its short factors while the sequence fits original_max_seq and
with its long ones after (rope.rope_angles). When a generated sequence grows past that length,
transformers drops its KV cache and recomputes the whole prefix with the long factors
(Phi3ForCausalLM.prepare_inputs_for_generation), so every key is rotated as a sequence of that
length rotates it. The decode step does the same, per row: the cache of a LongRoPE model keeps
each row's tokens by position (`history`, [batch, cache_seq]), and at the step whose token takes
position original_max_seq (the length becoming original_max_seq + 1) the row's first
original_max_seq + 1 tokens are prefilled again into a fresh cache (long factors, by their
length); that row takes its cache and its logits from there. Other rows keep theirs. The
recompute runs under lax.cond, only at steps where some row crosses.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mxc.spec.ir import LongRopeScaling, ModelSpec


def threshold(spec: ModelSpec) -> int | None:
    """original_max_seq of the spec's LongRoPE layers; None without LongRoPE."""
    found = {block.attention.rope.scaling.original_max_seq for block in spec.blocks.values()
             if getattr(block.attention, "rope", None) is not None
             and isinstance(block.attention.rope.scaling, LongRopeScaling)}
    if len(found) > 1:
        raise ValueError(f"LongRoPE layers with different original_max_seq ({sorted(found)}) are not supported")
    return found.pop() if found else None


def history_entry(spec: ModelSpec, batch: int, length: int) -> dict:
    """The cache's extra entry for a LongRoPE model: {"history": [batch, length] int32}; {} otherwise."""
    return {} if threshold(spec) is None else {"history": jnp.zeros((batch, length), jnp.int32)}


def with_history(cache: dict, before: dict, tokens: jax.Array, positions: jax.Array) -> dict:
    """`cache` (a step's output) with the history of `before` (its input, where it keeps one) and
    tokens [batch, seq] recorded at their positions [batch, seq]."""
    if "history" not in before:
        return cache
    rows = jnp.arange(tokens.shape[0])[:, None]
    return {**cache, "history": before["history"].at[rows, positions].set(tokens.astype(jnp.int32), mode="drop")}


def recompute_crossing_rows(spec: ModelSpec, positions: jax.Array, logits: jax.Array, cache: dict,
                            prefill_fresh: Callable[[jax.Array], tuple[jax.Array, dict]],
                            batch_axes: Callable[[dict], dict]) -> tuple[jax.Array, dict]:
    """After a decode step whose tokens took `positions` [batch]: (logits, cache) with the rows
    that just crossed original_max_seq taken from prefill_fresh(tokens [batch, original_max_seq + 1]),
    a prefill of their history into a fresh cache. batch_axes(cache) gives each cache leaf's batch axis."""
    limit = threshold(spec)
    crossing = positions == limit

    def recompute(operands):
        logits, cache = operands
        fresh_logits, fresh = prefill_fresh(cache["history"][:, :limit + 1])
        axes = batch_axes(cache)

        def pick(axis, new, old):
            shape = [1] * old.ndim
            shape[axis] = -1
            return jnp.where(crossing.reshape(shape), new.astype(old.dtype), old)

        merged = {key: jax.tree.map(pick, axes[key], fresh[key], value) if key in ("positions", "segments") else value
                  for key, value in cache.items()}
        return jnp.where(crossing[:, None], fresh_logits.astype(logits.dtype), logits), merged

    return jax.lax.cond(crossing.any(), recompute, lambda operands: operands, (logits, cache))
