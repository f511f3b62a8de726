"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p.

This is the one sampler of the project: an artifact's generation and `mxc generate MODEL` both
draw through it. It runs on the devices as one small jitted function next to the decode step (only
the chosen ids come back to the host). Randomness is a function of (seed, request, index of the
token among the new ones) alone, so a request with a given seed produces the same tokens whatever
batch it is served in, whether the program is an artifact's or jitted from the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Sampling:
    """Greedy takes the most likely token. Otherwise the logits are divided by `temperature`,
    cut to the `top_k` most likely tokens (ties with the k-th kept) and then to the smallest set
    whose probability reaches `top_p` (the most likely token always stays), and one is drawn."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.greedy:
            return
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be above 0, not {self.temperature} (use --greedy for argmax)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be at least 1, not {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must lie in (0, 1], not {self.top_p}")


def restrict(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Float32 logits [batch, vocab] with everything outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    removed = jnp.float32(-jnp.inf)
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth_largest, logits, removed)
    if sampling.top_p is not None and sampling.top_p < 1:
        descending = -jnp.sort(-logits, axis=-1)
        probabilities = jax.nn.softmax(descending, axis=-1)
        # A token stays while the mass of the tokens ranked above it is still short of top_p.
        mass_above = jnp.cumsum(probabilities, axis=-1) - probabilities
        smallest_kept = jnp.min(jnp.where(mass_above < sampling.top_p, descending, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= smallest_kept, logits, removed)
    return logits


@partial(jax.jit, static_argnames="sampling")
def next_tokens(logits: jax.Array, seed: jax.Array, requests: jax.Array, index: jax.Array, *,
                sampling: Sampling) -> jax.Array:
    """Token ids [batch] int32: the `index`-th new token of each row (index: a scalar or one per
    row), row i serving request requests[i] (an int array [batch])."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    requests = jnp.asarray(requests, jnp.uint32)
    index = jnp.broadcast_to(jnp.asarray(index, jnp.uint32), requests.shape)
    key = jax.random.key(seed)
    keys = jax.vmap(lambda request, i: jax.random.fold_in(jax.random.fold_in(key, i), request))(requests, index)
    restricted = restrict(logits, sampling)
    return jax.vmap(jax.random.categorical)(keys, restricted).astype(jnp.int32)


def warm(logits: jax.Array, sampling: Sampling, seed: int = 0) -> None:
    """Compile the sampler now, at load, for logits like these (a program's own output: jit
    compiles for the arguments' shapes and shardings) and the host arrays the generation driver
    passes, so that the first request's time to first token does not pay for it (tens of
    milliseconds on a CPU)."""
    batch = logits.shape[0]
    rows = np.arange(batch)  # the driver's request of each row, int64 as numpy makes them
    jax.block_until_ready(next_tokens(logits, seed, rows, np.zeros(batch, np.int32), sampling=sampling))
