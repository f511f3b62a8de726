"""A training run of the smallest model the loop can train (logits[t] = table[inputs[t]], Adam),
for fault tests in this process or in a child process: no artifact, no compile."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mxc.runtime.checkpoint import Checkpoints
from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun
from mxc.runtime.token_file import open_tokens, write_tokens
from mxc.runtime.trainable import Trainable

sys.path.insert(0, str(Path(__file__).parents[1]))  # scheduled_bigram lives in tests/
from scheduled_bigram import single_device_trainable, table_init  # noqa: E402

BATCH, SEQ = 4, 8
LLAMA = {"model": "llama3-tiny", "spec_hash": "3f2a" * 16, "topology": "cpu-1"}
QWEN = {"model": "qwen2.5-tiny", "spec_hash": "9b1c" * 16, "topology": "cpu-1"}


def bigram(identity: dict, vocab: int = 32) -> Trainable:
    optimizer = optax.adam(0.1)

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            logits = params["table"][batch["inputs"]]
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return ({"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}, {"loss": loss})

    return single_device_trainable(table_init(optimizer, vocab), train_step, None, vocab, identity=identity)


def token_file(path, length: int = 2000):
    """A token file of `length` random tokens below 31 (31 ends documents)."""
    stream = np.random.default_rng(0).integers(0, 31, length)
    write_tokens(path, [stream], vocab_size=32, eod_id=31, tokenizer="test")
    return open_tokens(path)


def train(trainable, tokens, directory, steps: int, *, save_every: int = 2, **kwargs) -> TrainingRun:
    run = TrainingRun(trainable, tokens, Checkpoints(directory, keep=None),
                      LoopConfig(steps=steps, save_every=save_every, progress=False), **kwargs)
    try:
        with StopSignal(multi_process=False) as stop:
            run.run(stop)
    finally:
        run.close()
    return run
