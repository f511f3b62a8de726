"""The train and eval steps: pure functions of (state, batch), ready for jit and AOT compilation.

A batch is a dict of [batch, seq] arrays (`batch_from_sequences` builds one from token
sequences one longer than the model's input):
    inputs   int32  the tokens the model reads
    targets  int32  the token expected at each position (inputs shifted left by one)
    mask     float32 or bool: 1 where the target counts toward the loss (0 for padding, prompts)
and, for rows that pack several documents (runtime/data.py; the compiled steps take them):
    segment_ids  int32  each token's document, so that attention stays inside it
    positions    int32  each token's position in its document (RoPE's), restarting at 0
and, for a model with a vision tower, a fixed number of image slots per row (image_slots.py):
    pixel_values float32 [batch, slots, channels, height, width]
    image_mask   bool    [batch, slots]: True where the slot holds an image
and, for a tiled tower (Llama 3.2 Vision), pixel_values [batch, slots, tiles, channels, height, width] and
    aspect_ratio_ids int32 [batch, slots]: each image's arrangement of tiles (0: none)

A train step splits the batch into `microbatches` equal parts along the batch axis, accumulates
gradients over them with lax.scan, and divides by the unmasked tokens of the whole batch, so
any number of microbatches gives the same update as one big batch, up to float error.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mxc.compiler.lower import remat as remat_lib
from mxc.compiler.lower.loss import LossSums, loss_metrics
from mxc.compiler.lower.moe import MoEConfig
from mxc.compiler.lower.optimizer import (OptimizerConfig, learning_rate_schedule, make_optimizer,
                                          weight_decay_mask)
from mxc.compiler.lower.sharding import constrain, named_sharding, tree_shardings
from mxc.spec.ir import ModelSpec

Batch = dict[str, jax.Array]
LossSumsFn = Callable[[object, Batch], LossSums]  # (params, batch) -> sums over the batch's tokens


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: updates applied so far
    params: object
    opt_state: object


def batch_from_sequences(sequences: jax.Array, mask: jax.Array | None = None) -> Batch:
    """Next-token batch from [batch, seq + 1] token sequences; `mask` [batch, seq + 1] marks real
    tokens, and a target counts only where it is a real token."""
    targets_mask = jnp.ones(sequences[:, 1:].shape, jnp.float32) if mask is None \
        else jnp.asarray(mask[:, 1:], jnp.float32)
    return {"inputs": sequences[:, :-1].astype(jnp.int32), "targets": sequences[:, 1:].astype(jnp.int32),
            "mask": targets_mask}


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    """[batch, ...] → [microbatches, batch / microbatches, ...], microbatch m taking rows m,
    m + microbatches, ...: with the batch axis sharded over devices, every device then holds an
    equal share of every microbatch, and the split moves no data."""
    def split(x):
        rows = x.shape[0]
        if rows % microbatches:
            raise ValueError(f"batch of {rows} rows does not split into {microbatches} microbatches")
        x = x.reshape(rows // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
    return jax.tree.map(split, batch)


def make_gradient_step(sums_fn: LossSumsFn, optimizer: optax.GradientTransformation,
                       schedule: optax.Schedule, *, microbatches: int = 1,
                       after_update: Callable[[object, LossSums], object] | None = None):
    """The model-independent train step, (state, batch, learning_rate=None) -> (state, metrics):
    `sums_fn` gives a batch's loss sums for some params; `optimizer` takes the update's rate as
    the extra argument `learning_rate` (make_optimizer's does), which is `learning_rate` when
    given, else `schedule(state.step)`.
    `after_update(params, sums)` adjusts the updated parameters outside the gradient (DeepSeek
    V3's correction biases follow the step's expert loads)."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")

    optimizer = optax.with_extra_args_support(optimizer)

    def train_step(state: TrainState, batch: Batch,
                   learning_rate: jax.Array | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
        # The rate of this update: given (a compiled step's input, computed by the runtime's
        # schedule) or the schedule's value at the state's step.
        rate = schedule(state.step) if learning_rate is None else jnp.asarray(learning_rate, jnp.float32)
        # One division by the whole batch's token count: the mean over all tokens, not a mean of
        # per-microbatch means (which would weight tokens by how padding fell).
        tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)

        def scaled_loss(params, part):
            sums = sums_fn(params, part)
            return sums.total() / tokens, sums

        grad_fn = jax.grad(scaled_loss, has_aux=True)
        if microbatches == 1:
            grads, sums = grad_fn(state.params, batch)
        else:
            def accumulate(carry, part):
                grad_total, sums_total = carry
                grads, sums = grad_fn(state.params, part)
                grad_total = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_total, grads)
                return (grad_total, jax.tree.map(jnp.add, sums_total, sums)), None

            zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            parts = split_microbatches(batch, microbatches)
            # Shaped like one microbatch's sums (a MoE model's carry per-layer expert loads).
            zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                     jax.eval_shape(sums_fn, state.params, jax.tree.map(lambda x: x[0], parts)))
            (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), parts)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, learning_rate=rate)
        params = optax.apply_updates(state.params, updates)
        if after_update is not None:
            params = after_update(params, sums)
        metrics = {**loss_metrics(sums), "grad_norm": optax.tree.norm(grads),
                   "learning_rate": rate}
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def _moments_on_host() -> bool:
    from mxc.compiler.lower.choices import lowering_choices

    return lowering_choices().optimizer_state_on_host


def layered_optimizer(spec: ModelSpec, config: OptimizerConfig) -> optax.GradientTransformationExtraArgs:
    """model_optimizer(spec, config), whose update, where the plan keeps AdamW's moments in host
    memory between steps (LoweringChoices.optimizer_state_on_host; train_state_shardings places
    them), brings them to HBM a layer at a time: the stacked layers' parameters are updated in a
    loop over the layers, each iteration moving that layer's moments in from the host stack and
    its updated moments back out; the other parameters' moments move whole. The clipping's global
    norm is taken first, over every gradient; the rest of AdamW is elementwise, so the update is the
    plain one's. Left to itself (every moment moved in at once), XLA's TPU scheduler starts the
    copies at the top of the step and HBM holds the moments throughout (docs/plans.md,
    "Optimizer state on host"). Frozen groups take the plain update."""
    from mxc.compiler.lower.optimizer import adamw_after_clipping
    from mxc.compiler.lower.params import param_axes, param_shapes

    plain = model_optimizer(spec, config)
    if config.freeze:
        return plain
    shapes, axes_tree = param_shapes(spec), param_axes(spec)
    axes = jax.tree.leaves(axes_tree, is_leaf=lambda a: isinstance(a, tuple))
    stacked = [a[:1] == ("layers",) for a in axes]
    # Stacks of different depths (DeepSeek V3: 3 dense layers, 58 MoE, 1 MTP module) loop apart.
    depths = [shape.shape[0] if s else 0 for s, shape in zip(stacked, jax.tree.leaves(shapes))]
    mask = jax.tree.leaves(weight_decay_mask(shapes, axes_tree))
    to_device, to_host = jax.memory.Space.Device, jax.memory.Space.Host

    def update(grads, state, params=None, *, learning_rate=None, **extra_args):
        if not _moments_on_host():
            return plain.update(grads, state, params, learning_rate=learning_rate, **extra_args)
        if config.clip_norm is not None:
            clip_state, (adam, decay, schedule) = state
            grads, clip_state = optax.clip_by_global_norm(config.clip_norm).update(grads, clip_state)
        else:
            adam, decay, schedule = state
        flat_grads, treedef = jax.tree.flatten(grads)
        flat_params, mu, nu = (treedef.flatten_up_to(tree) for tree in (params, adam.mu, adam.nu))
        # train_state_shardings keeps in HBM the moments libtpu cannot lay out in host memory;
        # each goes back where it came from.
        hosted = [jax.typeof(m).memory_space == to_host for m in mu]
        back = lambda x, i: jax.device_put(x, to_host) if hosted[i] else x  # noqa: E731

        def apply(which, g, m, v, p):
            """adamw on the parameters `which` (lists of their gradients, moments, values)."""
            transform = adamw_after_clipping(config, [mask[i] for i in which])
            inner = (adam._replace(mu=m, nu=v), decay, schedule)
            return transform.update(g, inner, p, learning_rate=learning_rate)

        whole = [i for i, s in enumerate(stacked) if not s]
        stacks: dict[int, list[int]] = {}
        for i, s in enumerate(stacked):
            if s:
                stacks.setdefault(depths[i], []).append(i)
        pick = lambda values, which: [values[i] for i in which]  # noqa: E731
        updates, (new_adam, decay_out, schedule_out) = apply(
            whole, pick(flat_grads, whole), [jax.device_put(m, to_device) for m in pick(mu, whole)],
            [jax.device_put(v, to_device) for v in pick(nu, whole)], pick(flat_params, whole))
        flat_updates, new_mu, new_nu = [None] * len(stacked), list(mu), list(nu)
        for slot, i in enumerate(whole):
            flat_updates[i] = updates[slot]
            new_mu[i], new_nu[i] = back(new_adam.mu[slot], i), back(new_adam.nu[slot], i)

        def one_layer(layered):
            def body(_, layer):
                g, m, v, p = layer
                done, (layer_adam, _, _) = apply(layered, g, [jax.device_put(x, to_device) for x in m],
                                                 [jax.device_put(x, to_device) for x in v], p)
                return None, (done, [back(x, i) for x, i in zip(layer_adam.mu, layered)],
                              [back(x, i) for x, i in zip(layer_adam.nu, layered)])
            return body

        for layered in stacks.values():
            _, (updates, layer_mu, layer_nu) = jax.lax.scan(
                one_layer(layered), None, tuple(pick(values, layered) for values in (flat_grads, mu, nu, flat_params)))
            for slot, i in enumerate(layered):
                flat_updates[i], new_mu[i], new_nu[i] = updates[slot], layer_mu[slot], layer_nu[slot]
        new_adam = adam._replace(count=new_adam.count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))
        inner = (new_adam, decay_out, schedule_out)
        return treedef.unflatten(flat_updates), (inner if config.clip_norm is None else (clip_state, inner))

    return optax.GradientTransformationExtraArgs(plain.init, update)


def make_eval_step(spec: ModelSpec, *, attention_impl: str = "xla", z_loss_weight: float = 0.0,
                   moe: MoEConfig = MoEConfig()):
    """(params, batch) -> metrics: per-token means plus `tokens`, to weight across batches.
    The model's own next-token loss: multi-token prediction is a training signal, left out here."""
    sums_fn = model_loss_sums(spec, attention_impl=attention_impl, z_loss_weight=z_loss_weight, moe=moe,
                              with_mtp=False)

    def eval_step(params, batch: Batch) -> dict[str, jax.Array]:
        return loss_metrics(sums_fn(params, batch))

    return eval_step


def model_loss_sums(spec: ModelSpec, *, remat: str = "none", attention_impl: str = "xla",
                    z_loss_weight: float = 0.0, moe: MoEConfig = MoEConfig(), with_mtp: bool = True,
                    pipeline=None) -> LossSumsFn:
    """The training loss's sums; with_mtp adds DeepSeek V3's multi-token prediction term (mtp.py)
    where the spec has one, and its modules' MoE statistics as one more segment's. `pipeline` (a
    pipeline.PipelineLayout) runs the largest segment through the circular pipeline."""
    # The layer library, imported late to keep this module light.
    from mxc.compiler.lower.model import decoder_hidden, head_loss_sums
    from mxc.compiler.lower.moe import add_moe_terms
    from mxc.compiler.lower.mtp import mtp_loss

    if attention_impl.startswith("splash"):
        from mxc.compiler.lower import splash  # noqa: F401  (registers the kernel with attention_core)

    def traced_sums(params, batch: Batch) -> LossSums:
        hidden, _, moe_stats = decoder_hidden(spec, params, batch["inputs"], remat_policy=remat_lib.policy(remat),
                                              positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
                                              pixel_values=batch.get("pixel_values"),
                                              image_mask=batch.get("image_mask"),
                                              aspect_ratio_ids=batch.get("aspect_ratio_ids"),
                                              attention_impl=attention_impl, moe=moe, pipeline=pipeline)
        sums = head_loss_sums(spec, params, hidden, batch["targets"], batch["mask"], z_loss_weight=z_loss_weight)
        if with_mtp and spec.mtp is not None:
            mtp_sum, mtp_stats = mtp_loss(spec, params, hidden, batch, remat_policy=remat_lib.policy(remat),
                                          attention_impl=attention_impl, moe=moe)
            sums = sums._replace(mtp=mtp_sum)
            moe_stats = [*moe_stats, mtp_stats]
        return add_moe_terms(sums, moe_stats, moe)

    def sums_fn(params, batch: Batch) -> LossSums:
        with remat_lib.offloading(remat):  # offloaded residual-shaped values in the backward's layout
            return traced_sums(params, batch)

    return sums_fn


def model_optimizer(spec: ModelSpec, config: OptimizerConfig) -> optax.GradientTransformation:
    """The optimizer for `spec`'s parameters, its decay mask read off their logical axes. The
    groups in config.freeze get no optimizer state and a zero update."""
    from mxc.compiler.lower.params import param_axes, param_shapes

    mask = weight_decay_mask(param_shapes(spec), param_axes(spec))
    if not config.freeze:
        return make_optimizer(config, decay_mask=mask)
    frozen = frozen_groups(spec, config.freeze)
    inner = make_optimizer(config, decay_mask=_trainable(mask, frozen))

    def init(params):
        return inner.init(_trainable(params, frozen))

    def update(updates, state, params=None, **extra_args):
        trained, state = inner.update(_trainable(updates, frozen), state,
                                      None if params is None else _trainable(params, frozen), **extra_args)
        return {**trained, **{name: jax.tree.map(jnp.zeros_like, updates[name]) for name in frozen}}, state

    return optax.GradientTransformationExtraArgs(init, update)


def frozen_groups(spec: ModelSpec, freeze: tuple[str, ...]) -> tuple[str, ...]:
    """The top-level parameter groups `freeze` names, checked against the model's."""
    from mxc.compiler.lower.params import param_shapes

    groups = tuple(param_shapes(spec))
    unknown = [name for name in freeze if name not in groups]
    if unknown:
        raise ValueError(f"cannot freeze {', '.join(unknown)}: {spec.name}'s parameter groups are "
                         f"{', '.join(groups)}")
    return tuple(freeze)


def _trainable(tree: dict, frozen: tuple[str, ...]) -> dict:
    return {name: value for name, value in tree.items() if name not in frozen}


def without_frozen_gradients(sums_fn: LossSumsFn, frozen: tuple[str, ...]) -> LossSumsFn:
    """sums_fn with the frozen groups held constant: their gradients are zero and XLA drops their
    backward pass (for a frozen vision tower, the whole encoder's)."""
    if not frozen:
        return sums_fn

    def frozen_sums(params, batch):
        return sums_fn({name: jax.lax.stop_gradient(value) if name in frozen else value
                        for name, value in params.items()}, batch)

    return frozen_sums


def make_train_step(spec: ModelSpec, config: OptimizerConfig, *, microbatches: int = 1,
                    remat: str = "full", attention_impl: str = "xla", z_loss_weight: float = 0.0,
                    moe: MoEConfig = MoEConfig(), pipeline=None):
    """(TrainState, Batch, learning_rate=None) -> (TrainState, metrics: loss, cross_entropy, z_loss,
    aux_loss, mtp_loss, accuracy, tokens, grad_norm (before clipping), learning_rate (the one this
    update used)). Without a learning rate, the config's schedule gives it. With a `pipeline`
    (pipeline.PipelineLayout) the pipeline splits the batch into its microbatches, in place of
    gradient accumulation."""
    from mxc.compiler.lower.moe import has_correction_bias, update_correction_biases
    from mxc.compiler.lower.mtp import update_mtp_correction_biases

    remat_lib.policy(remat)  # an unknown name fails here, listing the known ones
    after_update = None
    if has_correction_bias(spec) and moe.bias_update_rate > 0:
        def after_update(params, sums):
            params = update_correction_biases(spec, params, sums.expert_load, moe.bias_update_rate)
            if spec.mtp is not None:  # the modules' loads follow the layers' (model_loss_sums)
                params = update_mtp_correction_biases(spec, params, sums.expert_load[len(spec.layers)],
                                                      moe.bias_update_rate)
            return params
    sums_fn = model_loss_sums(spec, remat=remat, attention_impl=attention_impl, z_loss_weight=z_loss_weight,
                              moe=moe, pipeline=pipeline)
    return make_gradient_step(
        without_frozen_gradients(sums_fn, frozen_groups(spec, config.freeze)),
        layered_optimizer(spec, config), learning_rate_schedule(config),
        microbatches=1 if pipeline is not None else microbatches,
        after_update=after_update)


def init_train_state(spec: ModelSpec, config: OptimizerConfig, key: jax.Array) -> TrainState:
    from mxc.compiler.lower.params import init_params

    params = init_params(spec, key)
    return TrainState(jnp.zeros((), jnp.int32), params, model_optimizer(spec, config).init(params))


def abstract_train_state(spec: ModelSpec, config: OptimizerConfig) -> TrainState:
    """The train state's shapes and dtypes, traced from a traced seed: nothing runs on the host
    (a concrete key would compile and run jax's seeding on the CPU backend, whose code generator
    then stays resident through the accelerator compile and raises its peak memory; measured in
    docs/compile.md)."""
    return jax.eval_shape(lambda seed: init_train_state(spec, config, jax.random.key(seed)),
                          jax.ShapeDtypeStruct((), jnp.int32))


def _moment_sharding(sharding, param, axes: tuple):
    """Where a plan keeps the moments on host, one moment's sharding: in host memory where the
    target compiles it there (on a TPU, optimizer.host_tiles_accept), else in HBM."""
    from mxc.compiler.lower.optimizer import host_tiles_accept

    if sharding.mesh.devices.flat[0].platform == "tpu":
        splits = [math.prod(sharding.mesh.shape[name] for name in
                            ((entry,) if isinstance(entry, str) else (entry or ())))
                  for entry in (*sharding.spec, *[None] * (len(param.shape) - len(sharding.spec)))]
        local = tuple(-(-dim // split) for dim, split in zip(param.shape, splits))
        if not host_tiles_accept(local, axes[:1] == ("layers",)):
            return sharding
    return sharding.with_memory_kind("pinned_host")


def train_state_shardings(spec: ModelSpec, config: OptimizerConfig, mesh, rules, *,
                          moments_on_host: bool = False) -> TrainState:
    """NamedShardings for every leaf of the train state: the optimizer's moments are laid out
    like the parameters they track, in host memory (pinned_host) with `moments_on_host`
    (LoweringChoices.optimizer_state_on_host); counters are replicated, on device."""
    from mxc.compiler.lower.params import param_axes

    abstract = abstract_train_state(spec, config)
    axes = param_axes(spec)
    params = tree_shardings(axes, mesh, rules)
    replicated = named_sharding((), mesh, rules)
    moments = jax.tree.map(_moment_sharding, params, abstract.params, axes) if moments_on_host else params
    found = []

    def map_slots():
        # optax finds the parameter slots by initialising a throwaway state; under tracing its
        # counters are tracers, not arrays computed on the host.
        found.append(optax.tree_map_params(model_optimizer(spec, config), lambda _, sharding: sharding,
                                           abstract.opt_state, moments,
                                           transform_non_params=lambda _: replicated))
        return ()

    jax.eval_shape(map_slots)
    return TrainState(replicated, params, found[0])
