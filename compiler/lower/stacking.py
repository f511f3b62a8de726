"""Whether two projections of the same input run as one matmul over their stacked kernels.

On TPUs XLA then generates one kernel where it would generate two, forward and backward (keys
with values and gate with up take Llama 3.1 8B's train step for v5p-1024 from 72-76 to 57-65
CPU-seconds of compiling), and the larger matmul suits the MXUs. On CPUs the stacked copy of the
weights costs more than the shared matmul saves (a 100M-parameter step at 64 tokens is about a
fifth slower), so there the projections stay apart. The results are the same either way.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

from mxc.compiler.lower.sharding import active_rules

_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("mxc_stacked_projections", default=None)


def stacked_projections() -> bool:
    """True when compiling for a TPU mesh (or when forced, for tests)."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    active = active_rules()
    return active is not None and active[0].devices.flat[0].platform == "tpu"


@contextlib.contextmanager
def force_stacked_projections(value: bool):
    token = _FORCED.set(value)
    try:
        yield
    finally:
        _FORCED.reset(token)


def project_pair(x, first: dict, second: dict, dtype, pattern: str) -> tuple:
    """Two projections of x from one matmul over their kernels (the same shape) stacked on a new
    axis 1, which keeps each kernel's sharding. `pattern` is the einsum with that axis named in the
    kernel and leading the output, e.g. "bse,ekhd->kbshd"; each projection's bias is added."""
    kernel = jnp.stack([first["kernel"].astype(dtype), second["kernel"].astype(dtype)], axis=1)
    both = jnp.einsum(pattern, x, kernel)
    return tuple(y + p["bias"].astype(dtype) if "bias" in p else y for y, p in zip(both, (first, second)))
