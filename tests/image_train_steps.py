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


def masked_nll(logits, targets, mask) -> tuple[float, int]:
    """The summed negative log-likelihood of `targets` under `logits` [positions, vocab] where
    `mask` is set, in float64, and how many positions counted."""
    import numpy as np

    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -float(np.sum(log_probs[np.arange(len(targets)), targets] * mask)), int(mask.sum())


def train_step_batch_shapes(manifest: dict) -> dict:
    """An artifact's train-step batch inputs: {path within the batch: shape}."""
    return {tuple(leaf["path"][1:]): leaf["shape"] for leaf in manifest["functions"]["train_step"]["inputs"]
            if leaf["path"][0] == 1}
