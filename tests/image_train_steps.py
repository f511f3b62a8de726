"""One train step of a tiny multimodal model on packed image-text rows, shared by the tests that
check the step's loss against the forward pass run document by document."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def one_train_step(spec, rows: dict, *, remat: str, moved=None):
    """A fresh train state (its parameters passed through `moved` where given) and one step on
    `rows`: (the state before, the state after, the step's metrics)."""
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import init_train_state, make_train_step

    config = OptimizerConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0)
    state = init_train_state(spec, config, jax.random.key(0))
    if moved is not None:
        state = state._replace(params=moved(state.params))
    step = jax.jit(make_train_step(spec, config, remat=remat))
    after, metrics = step(state, {k: jnp.asarray(v) for k, v in rows.items()})
    return state, after, metrics
