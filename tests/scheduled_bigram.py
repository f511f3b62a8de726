"""A toy model trained by the real lowering's train step and optimizer (make_gradient_step,
make_optimizer) whose learning rate is a third argument, as in a compiled artifact: the loop's
schedule, TensorBoard and profile paths run in-process without compiling one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.compiler.lower.loss import loss_metrics, loss_sums
from mxc.compiler.lower.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from mxc.compiler.lower.train import TrainState, make_gradient_step
from mxc.runtime.data import BatchLayout
from mxc.runtime.trainable import Trainable

VOCAB, BATCH, SEQ = 32, 4, 8
# What an artifact's manifest records as run.optimizer: the defaults of `mxc run`'s schedule.
ARTIFACT_OPTIMIZER = {"learning_rate": 0.05, "total_steps": 100, "warmup_steps": None, "min_lr_ratio": 0.1}


def scheduled_bigram(flops_per_step: float | None = None, peak_flops: float | None = None) -> Trainable:
    """logits[t] = table[inputs[t]], trained with clipped AdamW at the rate it is given."""
    config = OptimizerConfig(**{k: v for k, v in ARTIFACT_OPTIMIZER.items() if v is not None})
    optimizer = make_optimizer(config)

    def sums(params, batch):
        return loss_sums(params["table"][batch["inputs"]], batch["targets"], batch["mask"])

    step = make_gradient_step(sums, optimizer, learning_rate_schedule(config))

    @jax.jit
    def train_step(state, batch, schedule):
        new, metrics = step(TrainState(state["step"], state["params"], state["opt_state"]), batch,
                            schedule["learning_rate"])
        return {"step": new.step, "params": new.params, "opt_state": new.opt_state}, metrics

    @jax.jit
    def eval_step(params, batch):
        return loss_metrics(sums(params, batch))

    return single_device_trainable(table_init(optimizer, VOCAB), train_step, eval_step, VOCAB,
                                   flops_per_step=flops_per_step, peak_flops=peak_flops, identity={"model": "bigram"})


def table_init(optimizer, vocab: int):
    """The state of a bigram table of `vocab` x `vocab` logits, small and random, with `optimizer`'s state."""
    def init(seed):
        params = {"table": jax.random.normal(jax.random.key(seed), (vocab, vocab)) * 0.01}
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
    return init


def single_device_trainable(init, train_step, eval_step, vocab: int, **fields) -> Trainable:
    """A model jitted on the first device as the loop sees it: the state replicated, batches of BATCH x SEQ."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                            jax.eval_shape(init, 0))
    layout = BatchLayout(BATCH, SEQ, NamedSharding(mesh, PartitionSpec("data")))
    return Trainable(init=init, train_step=train_step, eval_step=eval_step, abstract_state=abstract, layout=layout,
                     eval_layout=layout, vocab_size=vocab, **fields)
