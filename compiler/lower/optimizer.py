"""AdamW with linear warmup and cosine decay, weight decay only on matrices, global-norm clipping.

The learning rate is an argument of each update (`learning_rate=`, an optax extra argument): a
compiled train step takes it as an input and the runtime computes it every step
(mxc.runtime.schedule), so one artifact trains under any schedule. Without it an update uses
`learning_rate_schedule(config)`, the schedule these settings describe (and the runtime's defaults).

Defaults follow MaxText's base config (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1, clipping at
1.0, cosine down to a tenth of the peak, warmup over the first tenth of training), except the
peak learning rate, which is the common 3e-4 rather than MaxText's fine-tuning-sized 3e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat,
                      PositiveInt, model_validator)

# Parameters under a key containing one of these are never decayed (GPT-2/nanoGPT practice:
# decaying a norm's scale or a bias pulls the layer toward zero output, not toward simplicity).
NO_DECAY_KEYS = ("norm", "bias", "sinks")


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    learning_rate: PositiveFloat = 3e-4  # the peak, reached at the end of warmup
    total_steps: PositiveInt = 10_000  # the cosine reaches its floor here and stays there
    warmup_steps: NonNegativeInt | None = None  # None: the first tenth of total_steps
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)  # the floor, as a fraction of the peak
    b1: float = Field(default=0.9, ge=0.0, lt=1.0)
    b2: float = Field(default=0.95, ge=0.0, lt=1.0)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    clip_norm: PositiveFloat | None = 1.0  # global gradient norm; None: no clipping
    # Top-level parameter groups left as they are (e.g. "vision"): no gradient, no optimizer
    # state, no update (train.model_optimizer).
    freeze: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _warmup_fits(self):
        if self.warmup_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps})")
        return self

    @property
    def resolved_warmup_steps(self) -> int:
        return self.total_steps // 10 if self.warmup_steps is None else self.warmup_steps


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """0 → peak linearly over warmup, then a cosine from peak to peak·min_lr_ratio at total_steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.resolved_warmup_steps,
        decay_steps=config.total_steps,  # optax counts warmup inside decay_steps
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def _key_name(entry) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def decays(path, axes: tuple | None, ndim: int) -> bool:
    """Whether one parameter gets weight decay: matrices (embeddings included) do; norm scales,
    biases and other vectors do not. With logical axes, the stacking axis `layers` of scanned
    blocks does not count as a dimension, so a stacked norm scale [layers, embed] stays a vector."""
    if any(word in _key_name(entry).lower() for entry in path for word in NO_DECAY_KEYS):
        return False
    dims = ndim if axes is None else sum(1 for axis in axes if axis != "layers")
    return dims >= 2


def weight_decay_mask(params, axes=None):
    """A pytree of bools mirroring `params`: True where weight decay applies. `axes` is the
    parameters' logical-axes tree (param_axes); without it the array rank decides."""
    if axes is None:
        return jax.tree_util.tree_map_with_path(lambda path, p: decays(path, None, p.ndim), params)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if len(flat) != len(flat_axes):
        raise ValueError(f"axes tree has {len(flat_axes)} leaves, params have {len(flat)}")
    return jax.tree.unflatten(treedef, [decays(path, ax, p.ndim) for (path, p), ax in zip(flat, flat_axes)])


def scale_by_given_rate(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """optax's scale_by_learning_rate(schedule), except that an update given `learning_rate=`
    (a traced scalar) scales by minus that rate instead of the schedule's value at its count.
    Its state is scale_by_schedule's, so the optimizer state keeps optax.adamw's structure."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, learning_rate=None, **extra_args):
        del params, extra_args
        rate = schedule(state.count) if learning_rate is None else learning_rate
        updates = jax.tree.map(lambda g: -jnp.asarray(rate, g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(config: OptimizerConfig, decay_mask=None) -> optax.GradientTransformationExtraArgs:
    """Clip by global norm, then AdamW (optax.adamw's chain, its last link taking the rate as an
    argument). `decay_mask` is a bool pytree (or a function of params returning one); None means
    `weight_decay_mask(params)` by rank and name. `update(grads, state, params, learning_rate=LR)`
    uses LR; without it, the config's schedule."""
    adamw = adamw_after_clipping(config, decay_mask)
    if config.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)


def adamw_after_clipping(config: OptimizerConfig, decay_mask=None) -> optax.GradientTransformationExtraArgs:
    """make_optimizer's chain after the clipping: elementwise, so it also runs on any part of the
    parameters (train.layered_optimizer updates one layer's slice at a time)."""
    return optax.chain(
        optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
        optax.add_decayed_weights(config.weight_decay, weight_decay_mask if decay_mask is None else decay_mask),
        scale_by_given_rate(learning_rate_schedule(config)),
    )


# A layer's piece of a moment under this many elements stays in HBM where the plan keeps the
# moments on host: it saves nothing worth having, and libtpu refuses some such updates ("Updating
# the lane dimension is only supported when ..." on a stack of [32] or [32, 2, 16] pieces).
SMALLEST_HOSTED_PIECE = 4096


def host_tiles_accept(local_shape: tuple[int, ...], stacked: bool) -> bool:
    """Whether libtpu compiles a moment with this per-device shape in host memory, updated as
    train.layered_optimizer updates it (a stacked one a layer at a time). Its host layouts take
    (8,128) tiles of the last two dimensions of a layer's piece: with one of them neither a
    multiple of 8 nor at most 4 (DeepSeek V3's 7168 split 256 ways: 28) the compile fails
    ("Bitcast cannot have different shape sizes" on a one-layer stack, "layout does not match any
    allowed tile kind" at a deeper stack's dynamic slice), and a vector's piece needs whole lane
    rows (128). Found by compiling such updates for v5p (docs/plans.md, "Optimizer state on
    host"); the moments this refuses stay in HBM, which the planner counts
    (memory.hosted_moment_bytes)."""
    piece = local_shape[1:] if stacked else local_shape
    if math.prod(piece) < SMALLEST_HOSTED_PIECE:
        return False
    if len(piece) == 1:
        return piece[0] % 128 == 0
    return all(dim % 8 == 0 or dim <= 4 for dim in piece[-2:])
