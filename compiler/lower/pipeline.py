"""A circular (looped) pipeline over one scanned segment of identical layers, in pure JAX.

    pipelined_segment(spec, segment, params, x, positions, *, layout, segment_ids=None,
                      remat_policy=None, attention_impl="xla", moe=MoEConfig()) -> (x, stats)

The segment's first `layout.pipelined` layers are laid out [repeats, stages, layers_per_stage]
(flat layer (r * stages + s) * layers_per_stage + l), so stage s holds one group of layers per
repeat and the checkpoint keeps the flat layer order. The batch is split into `microbatches`
(rows m, m + microbatches, ... as the train step splits it). One lax.scan runs
microbatches * repeats + stages - 1 iterations; each is a vmap over stages (the stage dimension
split over the `stage` mesh axis), after which the stages' outputs rotate by one (XLA makes the
roll a collective-permute). Stage 0 reads the next microbatch from a buffer of microbatch
activations, and the last stage writes each finished pass back into it; iterations where a stage
has no microbatch (the bubble) are never written back and their MoE statistics are masked out.
The whole iteration is rematerialised under the plan's policy. Layers past the pipelined ones
(a layer count with no good divisor) run unpipelined afterwards, microbatch by microbatch.

MoE statistics come out stacked over the segment's layers as model.run_segment's do, computed per
microbatch as the train step's gradient accumulation computes them: loads and drops summed over
microbatches, the load-balancing loss averaged over them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mxc.compiler.lower.moe import MoEConfig, MoEStats
from mxc.compiler.lower.sharding import active_rules, constrain
from mxc.compiler.plan.plan import STAGE_AXIS  # the mesh axis the stage dimension is split over
from mxc.spec.ir import ModelSpec, Segment

STAGE_RESIDUAL_AXES = ("stage", "batch", "residual_seq", "embed")


class PipelineLayout(NamedTuple):
    stages: int
    microbatches: int
    repeats: int = 1

    def layers_per_stage(self, layers: int) -> int:
        return layers // (self.stages * self.repeats)

    def pipelined(self, layers: int) -> int:
        """How many of the segment's first layers the pipeline runs (the rest run after it)."""
        return self.layers_per_stage(layers) * self.stages * self.repeats

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of stage-iterations with no microbatch: (stages - 1) / iterations."""
        return (self.stages - 1) / self.iterations

    def check(self, layers: int, batch: int) -> None:
        if self.stages < 1 or self.microbatches < 1 or self.repeats < 1:
            raise ValueError(f"pipeline stages, microbatches and repeats must be at least 1, got {tuple(self)}")
        if self.layers_per_stage(layers) < 1:
            raise ValueError(f"{layers} layers do not fill {self.stages} stages x {self.repeats} repeats")
        if batch % self.microbatches:
            raise ValueError(f"batch of {batch} rows does not split into {self.microbatches} pipeline microbatches")
        if self.repeats > 1 and self.microbatches < self.stages:
            # A microbatch leaving the last stage must find stage 0 free for its next repeat.
            raise ValueError(f"a circular pipeline needs at least as many microbatches ({self.microbatches}) "
                             f"as stages ({self.stages})")


def pipelined_segment_index(spec: ModelSpec) -> int:
    """The segment a plan with stages pipelines: the one with the most layers (the first of those)."""
    repeats = [segment.repeat for segment in spec.layers]
    return repeats.index(max(repeats))


def _split(x: jax.Array, parts: int) -> jax.Array:
    """[batch, ...] → [parts, batch / parts, ...], part m taking rows m, m + parts, ... (so a
    batch sharded over devices stays evenly spread and the split moves no data)."""
    return x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1)


def _merge(x: jax.Array) -> jax.Array:
    """_split's inverse."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_split(tree, stage_count: int):
    """Pin leading dimension 0 of every leaf to the stage mesh axis (the rest left to XLA)."""
    active = active_rules()
    if active is None:
        return tree
    mesh, _ = active
    if mesh.shape.get(STAGE_AXIS, 1) != stage_count or stage_count == 1:
        return tree

    def pin(a):
        spec = PartitionSpec(STAGE_AXIS, *([PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    return jax.tree.map(pin, tree)


def _stage_vmap(f, stage_count: int):
    """vmap over stages; under a mesh with a stage axis, the layers' own sharding constraints
    gain that axis on the vmapped dimension instead of replicating it."""
    active = active_rules()
    if active is not None and active[0].shape.get(STAGE_AXIS, 1) == stage_count > 1:
        return jax.vmap(f, spmd_axis_name=STAGE_AXIS)
    return jax.vmap(f)


def _whole_batch_for_experts(spec: ModelSpec, segment: Segment):
    """Inside the stages' vmap, MoE layers route the whole microbatch under XLA's partitioner: their
    per-batch-shard shard_map does not take the vmapped stage dimension (jax 0.10.2: its operand
    arrives split over `stage` where the region expects it whole). Dense segments keep the rules."""
    from contextlib import nullcontext

    from mxc.compiler.kinds import kind_of
    from mxc.compiler.lower.sharding import use_rules

    active = active_rules()
    routed = any(kind_of(spec.blocks[name].mlp).routing(spec.blocks[name].mlp) is not None for name in segment.period)
    if active is None or not routed:
        return nullcontext()
    mesh, rules = active
    return use_rules(mesh, {**rules, "batch": ()})


def _per_microbatch_stats(stats: list, microbatches: int) -> list:
    """Statistics summed over microbatches → the train step's per-microbatch convention."""
    return [None if s is None else s._replace(aux_loss=s.aux_loss / microbatches) for s in stats]


def pipelined_segment(spec: ModelSpec, segment: Segment, params: list, x: jax.Array, positions: jax.Array, *,
                      layout: PipelineLayout, segment_ids: jax.Array | None = None, remat_policy=None,
                      attention_impl: str = "xla", moe: MoEConfig = MoEConfig()) -> tuple[jax.Array, list]:
    """Run one segment (model.run_segment's stacked params) through the circular pipeline; returns
    (x after the segment, its MoE statistics per period block, stacked over its layers)."""
    from mxc.compiler.lower.model import run_segment

    layers = jax.tree.leaves(params)[0].shape[0]
    layout.check(layers, x.shape[0])
    S, M, R = layout.stages, layout.microbatches, layout.repeats
    L = layout.layers_per_stage(layers)
    piped = layout.pipelined(layers)

    # [layers, ...] → [stages, repeats, layers_per_stage, ...]: stage s, repeat r holds flat layers
    # (r * S + s) * L ... + L - 1.
    staged = jax.tree.map(lambda a: a[:piped].reshape(R, S, L, *a.shape[1:]).swapaxes(0, 1), params)
    staged = _stage_split(staged, S)
    if segment_ids is None:
        segment_ids_mb = None
    else:
        segment_ids_mb = _split(segment_ids, M)
    positions_mb = _split(positions, M)
    buffer = _split(x, M)  # [M, mb, seq, embed]: each microbatch's activation between passes
    stage_index = jnp.arange(S)

    def stage(stage_params, repeat, x, pos, seg):
        group = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), stage_params)
        with _whole_batch_for_experts(spec, segment):
            y, _, stats = run_segment(spec, segment, group, x, pos, segment_ids=seg, attention_impl=attention_impl,
                                      moe=moe)
        return y, stats

    def iteration(carry, t):
        state, buffer, totals = carry
        work = t - stage_index  # [S]: each stage's pass index; a microbatch is m = work % M, repeat work // M
        valid = (work >= 0) & (work < M * R)
        micro = jnp.mod(work, M)
        repeat = jnp.clip(work // M, 0, R - 1)
        fresh = jax.lax.dynamic_index_in_dim(buffer, jnp.mod(t, M), 0, keepdims=False)
        inputs = jnp.where((stage_index == 0)[:, None, None, None], fresh[None], state)
        inputs = constrain(inputs, STAGE_RESIDUAL_AXES)
        pos = jnp.take(positions_mb, micro, axis=0)
        seg = None if segment_ids_mb is None else jnp.take(segment_ids_mb, micro, axis=0)
        outputs, stats = _stage_vmap(stage, S)(staged, repeat, inputs, pos, seg)
        outputs = constrain(outputs, STAGE_RESIDUAL_AXES)
        # The last stage's finished pass goes back to its microbatch's slot; a bubble writes nothing.
        done = work[S - 1]
        slot = jnp.mod(done, M)
        kept = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
        written = jnp.where(valid[S - 1], outputs[S - 1], kept)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, written, slot, 0)
        # Stage s's statistics belong to layer group [repeat, s]; masked where it had no microbatch.
        where = jax.nn.one_hot(repeat, R, dtype=jnp.float32) * valid[:, None]  # [S, R]
        totals = jax.tree.map(
            lambda total, s: total + jnp.einsum("sr,sl...->rsl...", where, s.astype(jnp.float32)), totals, stats)
        state = constrain(jnp.roll(outputs, 1, axis=0), STAGE_RESIDUAL_AXES)
        return (state, buffer, totals), None

    if remat_policy is not None:
        iteration = jax.checkpoint(iteration, policy=remat_policy, prevent_cse=False)
    mb_shape = buffer.shape[1:]
    state = jnp.zeros((S, *mb_shape), x.dtype)
    stat_shapes = jax.eval_shape(lambda: _stage_vmap(stage, S)(
        staged, jnp.zeros((S,), jnp.int32), state, jnp.take(positions_mb, jnp.zeros((S,), jnp.int32), axis=0),
        None if segment_ids_mb is None else jnp.take(segment_ids_mb, jnp.zeros((S,), jnp.int32), axis=0)))[1]
    totals = jax.tree.map(lambda s: jnp.zeros((R, *s.shape), jnp.float32), stat_shapes)
    (_, buffer, totals), _ = jax.lax.scan(iteration, (state, buffer, totals), jnp.arange(layout.iterations))
    stats = [None if s is None else MoEStats(*(t.reshape(piped, *t.shape[3:]) for t in s)) for s in totals]

    if piped < layers:
        rest = jax.tree.map(lambda a: a[piped:], params)

        def one_microbatch(inputs):
            x, pos, seg = inputs
            y, _, s = run_segment(spec, segment, rest, x, pos, segment_ids=seg, remat_policy=remat_policy,
                                  attention_impl=attention_impl, moe=moe)
            return y, s

        buffer, rest_stats = jax.lax.map(one_microbatch, (buffer, positions_mb, segment_ids_mb))
        stats = [None if a is None else MoEStats(*(jnp.concatenate([u, jnp.sum(v, axis=0)]) for u, v in zip(a, b)))
                 for a, b in zip(stats, rest_stats)]
    return _merge(buffer), _per_microbatch_stats(stats, M)
