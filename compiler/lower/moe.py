"""Mixture-of-experts layers: the router, the routed experts, shared experts, training statistics.

    moe_layer(moe, params, x, config=MoEConfig()) -> (y, MoEStats)

x and y are [batch, seq, embed]; params is the layer's "mlp" tree (params.moe_defs).

Routing (`route`) runs in float32 and covers the reference routers: softmax or sigmoid scores;
selection within the best `top_groups` of `groups` expert groups; DeepSeek V3's correction bias,
added for selection only; top-k weights renormalised to sum to one; routed_scale; a bias on the
router's projection (GPT-OSS); Llama 4's weighting of the expert's input instead of its output.

The routed experts run along one of three paths, which compute the same function wherever no
token is dropped (MoEConfig.path, a choice of the plan):

  dropless  assignments sorted by expert, then grouped matmuls over the sorted rows: every
            assignment computed, FLOPs proportional to top_k. The default, and the plans'
            wherever their rules split the experts. There each device sends its tokens to the
            devices that hold their experts (expert_dispatch.py: ragged all-to-alls, megablox's
            kernel on TPU); elsewhere each batch shard sorts its own tokens for
            the same grouped matmul (megablox on TPU, jax.lax.ragged_dot elsewhere; see moe_layer).
  capacity  GShard/Switch dense dispatch: within each sequence every expert takes at most
            `capacity` assignments (first choices before second choices, earlier tokens first),
            gathered and scattered with one-hot einsums. Static shapes, partitioned by XLA like
            any einsum, drops assignments past capacity; for small expert counts.
  dense     every expert on every token, masked by the routing: E/top_k times the FLOPs, the
            numerical reference the other two are tested against.

Experts carry the logical axis `experts` on every weight, so expert parallelism is the sharding
rule `experts -> expert`. Routing statistics come back per layer for the load-balancing loss and
for DeepSeek V3's bias update (`update_correction_biases`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, PositiveFloat

from mxc.compiler.lower.choices import lowering_choices, use_lowering
from mxc.compiler.lower.expert_dispatch import DispatchPlan, dispatch_experts
from mxc.compiler.lower.expert_rows import expert_ffn, grouped_matmul, sort_assignments
from mxc.compiler.lower.ffn import ffn_layer, hidden_activation
from mxc.compiler.lower.params import moe_defs, shared_expert_ffn
from mxc.compiler.lower.projection import active_config, project as project_kernel, weight as kernel_weight
from mxc.compiler.lower.remat import named_residual
from mxc.compiler.lower.sharding import RESIDUAL_AXES, active_rules, constrain, partition_spec, use_rules
from mxc.spec.ir import MoE, ModelSpec, Router

EXPERT_PATHS = ("dropless", "capacity", "dense")


class MoEConfig(BaseModel):
    """How MoE layers run and train. Not part of the model: the plan chooses it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Literal["dropless", "capacity", "dense"] = "dropless"
    # Capacity path: each expert takes ceil(factor · seq · top_k / experts) assignments per sequence.
    capacity_factor: PositiveFloat = 1.25
    # Weight of the load-balancing loss in the training loss (Switch and MaxText use 0.01;
    # HF configs carry router_aux_loss_coef = 0.001 for the same loss times top_k).
    aux_loss_weight: NonNegativeFloat = 0.01
    # DeepSeek V3's γ: correction biases move by this much per step against the load imbalance.
    bias_update_rate: NonNegativeFloat = 1e-3


class Routing(NamedTuple):
    experts: jax.Array  # [tokens, top_k] int32: the chosen experts, best first
    weights: jax.Array  # [tokens, top_k] float32: their weights (normalised, routed_scale applied)
    probs: jax.Array  # [tokens, experts] float32: scores normalised over the experts (for the aux loss)


class MoEStats(NamedTuple):
    """One layer's routing statistics (stacked over the layers of a scanned segment)."""

    aux_loss: jax.Array  # scalar: the load-balancing loss, 1 when perfectly balanced
    expert_load: jax.Array  # [experts] float32: assignments routed to each expert
    dropped: jax.Array  # scalar float32: assignments past capacity (0 on the dropless and dense paths)


# ---------------------------------------------------------------- routing

def _best_groups(choice: jax.Array, router: Router) -> jax.Array:
    """Selection scores with every expert outside the token's best `top_groups` groups at -inf."""
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, router.groups, experts // router.groups)
    if router.correction_bias:
        # DeepSeek V3 (noaux_tc) ranks a group by the sum of its two best experts ...
        group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
    else:
        # ... DeepSeek V2 (group_limited_greedy) by its best one.
        group_score = grouped.max(-1)
    best = jax.lax.top_k(group_score, router.top_groups)[1]
    keep = jax.nn.one_hot(best, router.groups, dtype=jnp.bool_).any(axis=-2)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def route(moe: MoE, params: dict, x: jax.Array) -> Routing:
    """x [tokens, embed] -> the routing of each token; params is the "router" tree."""
    router = moe.router
    # Routing decisions are discrete: a bfloat16 logit would flip near-ties, so all of it is float32.
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), params["kernel"].astype(jnp.float32))
    if router.bias:
        logits = logits + params["bias"].astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if router.score == "softmax" else jax.nn.sigmoid(logits)
    if router.correction_bias:
        choice = scores + jax.lax.stop_gradient(params["correction_bias"].astype(jnp.float32))
    elif router.groups > 1:
        choice = scores
    else:
        # Same order as the scores (both maps are monotone), and exact where a sigmoid saturates.
        choice = logits
    if router.groups > 1:
        choice = _best_groups(choice, router)
    chosen = jax.lax.top_k(choice, moe.top_k)[1].astype(jnp.int32)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if router.normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * router.routed_scale
    probs = scores if router.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routing(chosen, weights, probs)


def load_balancing_loss(mean_probs: jax.Array, load: jax.Array) -> jax.Array:
    """Switch Transformer's loss (Fedus et al. 2021, eq. 4): experts · Σ_e f_e · P_e, where f_e is
    the fraction of assignments routed to expert e (load [experts]) and P_e its mean router
    probability over the tokens (mean_probs [experts]). It is 1 under perfect balance and grows
    toward `experts` as routing collapses onto one expert. (HF's load_balancing_loss_func
    computes top_k times this.)"""
    return load.shape[0] * jnp.sum(load / jnp.sum(load) * mean_probs)


# ---------------------------------------------------------------- expert paths

def _weight_matrix(routing: Routing, experts: int) -> tuple[jax.Array, jax.Array]:
    """([tokens, experts] 0/1 selection, [tokens, experts] weights, 0 where not selected)."""
    one_hot = jax.nn.one_hot(routing.experts, experts, dtype=jnp.float32)
    return one_hot.sum(1), jnp.einsum("tke,tk->te", one_hot, routing.weights)


def _dense(moe: MoE, params: dict, x: jax.Array, routing: Routing, config: MoEConfig, batch: int):
    """Every expert on every token [tokens, embed]; the numerical reference."""
    dtype = x.dtype
    selected, weight = _weight_matrix(routing, moe.experts)
    on_input = moe.router.weight_on == "input"
    # Llama 4 feeds each expert the token scaled by its weight; the others scale the output.
    inputs = x[:, None, :] * weight[:, :, None].astype(dtype) if on_input else x

    def project(name):
        pattern = "ted,edh->teh" if on_input else "td,edh->teh"
        return checkpoint_name(project_kernel(inputs, params[name], pattern, dtype, mlp=True), "mlpwi")

    gate = project("gate") if "gate" in params else None
    hidden = hidden_activation(moe.expert, gate, project("up"))
    out = project_kernel(hidden, params["down"], "teh,ehd->ted", dtype, mlp=True)
    scale = selected if on_input else weight
    return jnp.einsum("ted,te->td", out, scale.astype(dtype)), jnp.zeros((), jnp.float32)


def _dropless_rows(moe: MoE, params: dict, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """x [tokens, embed] with its experts and weights [tokens, top_k]: the assignments sorted by
    expert, grouped matmuls over the sorted rows, then unsorted and summed per token."""
    dtype = x.dtype
    sorted_rows = sort_assignments(moe, x, experts, weights)

    def project(name, inputs):
        # Every assignment is a row of its expert's group: nothing to mask.
        y = grouped_matmul(inputs, kernel_weight(params[name], dtype, mlp=True, contracting=(1,)),
                           sorted_rows.group_sizes, every_row_grouped=True)
        if "bias" in params[name]:
            y = y + params[name]["bias"].astype(dtype)[sorted_rows.experts]
        return y

    return expert_ffn(moe, params, sorted_rows, experts.shape[0], project)


def _dropless(moe: MoE, params: dict, x: jax.Array, routing: Routing, config: MoEConfig, batch: int):
    return _dropless_rows(moe, params, x, routing.experts, routing.weights), jnp.zeros((), jnp.float32)


def capacity(seq: int, top_k: int, experts: int, factor: float) -> int:
    """Assignments one expert takes per sequence: factor times a fair share, at most every token."""
    return max(1, min(seq, math.ceil(factor * seq * top_k / experts)))


def _capacity(moe: MoE, params: dict, x: jax.Array, routing: Routing, config: MoEConfig, batch: int):
    """GShard's dense dispatch with a per-sequence capacity; drops what does not fit."""
    dtype = x.dtype
    experts, top_k = moe.experts, moe.top_k
    seq = x.shape[0] // batch
    slots = capacity(seq, top_k, experts, config.capacity_factor)
    chosen = routing.experts.reshape(batch, seq, top_k)
    one_hot = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [batch, seq, top_k, experts]
    # Queue order within a sequence: every token's first choice, then every second choice, ...
    queued = one_hot.transpose(0, 2, 1, 3).reshape(batch, top_k * seq, experts)
    ahead = (jnp.cumsum(queued, axis=1) - queued).reshape(batch, top_k, seq, experts).transpose(0, 2, 1, 3)
    position = jnp.sum(ahead * one_hot, axis=-1)  # [batch, seq, top_k]: place in its expert's queue
    kept = (position < slots).astype(dtype)
    slot = jax.nn.one_hot(position, slots, dtype=dtype)  # all zeros past capacity
    dispatch = jnp.einsum("bske,bskc->bsec", one_hot.astype(dtype) * kept[..., None], slot)
    weights = routing.weights.reshape(batch, seq, top_k).astype(dtype)
    combine = jnp.einsum("bske,bskc->bsec", one_hot.astype(dtype) * (kept * weights)[..., None], slot)
    on_input = moe.router.weight_on == "input"
    tokens = x.reshape(batch, seq, -1)
    expert_in = jnp.einsum("bsec,bsd->becd", combine if on_input else dispatch, tokens)
    expert_in = constrain(expert_in, ("batch", "experts", None, "embed"))

    def project(name, inputs, pattern):
        y = project_kernel(inputs, {k: v for k, v in params[name].items() if k != "bias"}, pattern, dtype,
                           mlp=True)
        if "bias" in params[name]:
            y = y + params[name]["bias"].astype(dtype)[None, :, None, :]
        return y

    gate = checkpoint_name(project("gate", expert_in, "becd,edh->bech"), "mlpwi") if "gate" in params else None
    up = checkpoint_name(project("up", expert_in, "becd,edh->bech"), "mlpwi")
    out = project("down", hidden_activation(moe.expert, gate, up), "bech,ehd->becd")
    out = constrain(out, ("batch", "experts", None, "embed"))
    y = jnp.einsum("becd,bsec->bsd", out, dispatch if on_input else combine)
    dropped = jnp.sum(1.0 - kept.astype(jnp.float32))
    return y.reshape(batch * seq, -1), dropped


# ---------------------------------------------------------------- the layer

PATHS = {"dropless": _dropless, "capacity": _capacity, "dense": _dense}


def _routed(moe: MoE, params: dict, x: jax.Array, config: MoEConfig, total, path=None) -> tuple[jax.Array, MoEStats]:
    """Router and routed experts on x [batch, seq, embed]; `total` sums a statistic over the batch
    shards (the identity when x is the whole batch); `path` overrides config.path's function."""
    batch, seq, d_model = x.shape
    tokens = x.reshape(batch * seq, d_model)
    routing = route(moe, params["router"], tokens)
    y, dropped = (path or PATHS[config.path])(moe, params["experts"], tokens, routing, config, batch)
    load = total(jnp.bincount(routing.experts.reshape(-1), length=moe.experts).astype(jnp.float32))
    mean_probs = total(jnp.sum(routing.probs, axis=0)) / total(jnp.float32(batch * seq))
    stats = MoEStats(load_balancing_loss(mean_probs, load), load, total(dropped))
    return y.reshape(batch, seq, d_model).astype(x.dtype), stats


def _batch_split(batch: int):
    """(mesh, rules without the batch's mesh axes, those axes, the batch's PartitionSpec) when the
    active sharding rules split the batch evenly; else None."""
    active = active_rules()
    if active is None:
        return None
    mesh, rules = active
    axes = partition_spec(("batch",), rules, mesh)[0]
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if batch % math.prod(mesh.shape[n] for n in names):
        return None
    inner = {logical: tuple(m for m in mesh_axes if m not in names) for logical, mesh_axes in rules.items()}
    return mesh, inner, names, PartitionSpec(axes)


def megablox_hidden_axes(mesh_shape: Mapping[str, int], batch_axes: Iterable[str],
                         hidden_axes: Sequence[str], down_bias: bool) -> tuple[str, ...] | None:
    """Whether a dropless layer with unsplit experts runs megablox in a region manual over every
    mesh axis, and how: () where the batch's axes are the mesh's only axes of more than one
    device; the axes splitting the experts' hidden units where those are the only others and
    `down` has no bias (each device's partial output is summed, and a bias would be summed with
    it); None where neither holds. The one rule for the lowering (moe_layer), the memory model
    (compiler/plan/activations.py) and the search (compiler/plan/candidates.py)."""
    batch = set(batch_axes)
    others = {axis for axis, size in mesh_shape.items() if size > 1 and axis not in batch}
    if not others:
        return ()
    hidden = tuple(axis for axis in hidden_axes if mesh_shape.get(axis, 1) > 1)
    return hidden if others == set(hidden) and not down_bias else None


def moe_layer(moe: MoE, params: dict, x: jax.Array, config: MoEConfig = MoEConfig()) -> tuple[jax.Array, MoEStats]:
    """x [batch, seq, embed] -> ([batch, seq, embed], this layer's MoEStats).

    Under sharding rules that split the batch, routing and routed experts run per batch shard
    (a shard_map, manual over the batch's mesh axes): each shard sorts or dispatches only its own
    tokens, where one global sort or top-k would gather every token onto every data-parallel
    replica. The dropless path with split experts sends tokens to their experts' devices
    instead (_routed_expert_parallel). Otherwise the expert weights stay under XLA's
    partitioner, which splits the capacity path's expert matmuls along a sharded `experts` axis
    and sums the partial results."""
    if config.path not in PATHS:
        raise ValueError(f"unknown expert path {config.path!r}; choose one of {', '.join(EXPERT_PATHS)}")
    routed_params = {"router": params["router"], "experts": params["experts"]}
    split = _batch_split(x.shape[0])
    expert_parallel = _expert_parallel_layout(moe, x) if config.path == "dropless" else None
    if expert_parallel is not None:
        y, stats = _routed_expert_parallel(moe, routed_params, x, config, expert_parallel)
    elif split is None:
        y, stats = _routed(moe, routed_params, x, config, total=lambda v: v)
    else:
        mesh, inner_rules, names, spec = split
        # Inside, the active mesh is abstract (no devices to read the platform from): the body
        # keeps the lowering choices of the concrete mesh outside.
        choices = lowering_choices()
        manual = frozenset(names)
        hidden = ()  # mesh axes splitting the experts' hidden units inside the region
        if config.path == "dropless" and choices.grouped_matmul == "megablox":
            # A Pallas kernel is not partitioned by XLA: megablox needs a region manual over every
            # mesh axis, which the batch's axes are when the others have one device, or when the
            # others only split the experts' hidden units (tensor): each device then runs its
            # slice of every expert and the partial outputs are summed, as MaxText's dropless
            # path does. Otherwise the rows go through ragged_dot (on TPU a masked matmul over
            # every expert: plans take this path only on such meshes, compiler/plan/candidates.py).
            hidden_names = _names_of(partition_spec(("mlp",), active_rules()[1], mesh)[0])
            region = megablox_hidden_axes(dict(mesh.shape), names, hidden_names,
                                          "bias" in params["experts"]["down"])
            if region is not None:
                manual, inner_rules, hidden = frozenset(mesh.axis_names), {}, region
            else:
                choices = dataclasses.replace(choices, grouped_matmul="ragged_dot")

        if manual == frozenset(mesh.axis_names):
            weight_specs, gathers = _expert_inputs(routed_params["experts"], moe, x.shape[-1], manual,
                                                   keep=("mlp",) if hidden else ())
        else:
            # Partly manual (ragged_dot beside a tensor axis): the weights enter whole, as the
            # partitioner splits ragged_dot's masked matmul better than a gathered weight
            # (Llama 4 Maverick, fsdp 32 x tensor 4: 96.69 GiB whole, 109.02 gathered inside).
            weight_specs = jax.tree.map(lambda _: PartitionSpec(), routed_params["experts"])
            gathers = jax.tree.map(lambda _: (), routed_params["experts"])

        def per_shard(p, x):
            p = {**p, "experts": _gathered(p["experts"], gathers, x.dtype)}
            # Constraints inside name the mesh as shard_map sees it, its batch axes manual.
            with use_rules(jax.sharding.get_abstract_mesh(), inner_rules), use_lowering(choices):
                y, stats = _routed(moe, p, x, config, total=lambda v: jax.lax.psum(v, names))
            # Each hidden slice's `down` product is a partial sum of the output.
            return (jax.lax.psum(y, hidden) if hidden else y), stats

        param_specs = {"router": jax.tree.map(lambda _: PartitionSpec(), routed_params["router"]),
                       "experts": weight_specs}
        # check_vma off: with it, the gradient of this region inside the scanned layers crashes
        # XLA:CPU's compiler (jax 0.10.2: "Invalid binary instruction opcode copy").
        y, stats = jax.shard_map(per_shard, mesh=mesh, in_specs=(param_specs, spec),
                                 out_specs=(spec, PartitionSpec()), axis_names=manual,
                                 check_vma=False)(routed_params, x)
    if moe.shared_experts:
        y = y + ffn_layer(shared_expert_ffn(moe), params["shared"], x)
    return named_residual(constrain(y, RESIDUAL_AXES), "mlpwo"), stats


def _shard_index(names: tuple[str, ...], mesh) -> jax.Array:
    """This device's position along `names` (row-major, as a PartitionSpec entry splits a dimension)."""
    index = jnp.zeros((), jnp.int32)
    for name in names:
        index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return index


def _names_of(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _expert_specs(moe: MoE, d_model: int, rules, mesh) -> dict:
    """PartitionSpecs of the expert weights for a region manual over every mesh axis. A grouped
    matmul wants every row's whole input: the embed dimension is gathered, not split."""
    expert_axes = jax.tree.map(lambda d: tuple(None if a == "embed" else a for a in d.axes),
                               moe_defs(moe, d_model)["experts"], is_leaf=lambda d: hasattr(d, "axes"))
    return jax.tree.map(lambda axes: partition_spec(axes, rules, mesh), expert_axes,
                        is_leaf=lambda a: isinstance(a, tuple))


def _expert_inputs(experts: dict, moe: MoE, d_model: int, manual, keep: tuple[str, ...] = ()):
    """(in_specs, gathers) for the expert weights entering a shard_map manual over the mesh axes
    `manual`: each weight enters as stored, split over those axes, and is gathered inside over
    every one of them that splits a dimension whose logical axis is not in `keep` (`gathers`:
    per leaf, (dimension, mesh axes) pairs). Entering whole instead, a weight is gathered by XLA
    before the region in its stored dtype, and the transpose of that replication is an
    all-reduce of the whole gradient: DeepSeek V3 on v5p-1024 (fsdp 512) all-reduced each
    layer's [256, 2048, 7168] expert gradient in float32, 14 GiB live at XLA's peak. Gathered
    inside, the transpose is a reduce-scatter onto the device's own piece, in the compute dtype
    (_gathered); there XLA's TPU compiler runs it as a bfloat16 all-reduce and a slice, 7 GiB.
    Leaves without a definition (a quantized kernel's scales) enter whole, as before."""
    active = active_rules()
    mesh, rules = active
    defs = moe_defs(moe, d_model)["experts"]

    def entry(path, leaf):
        node = defs
        for key in path:
            node = node.get(key.key) if isinstance(node, dict) else None
        if not hasattr(node, "axes") or len(node.axes) != leaf.ndim:
            return PartitionSpec(), ()
        names = [tuple(n for n in _names_of(e) if n in manual)
                 for e in partition_spec(node.axes, rules, mesh)]
        names += [()] * (leaf.ndim - len(names))
        spec = PartitionSpec(*(None if not n else n[0] if len(n) == 1 else n for n in names))
        return spec, tuple((dim, n) for dim, (axis, n) in enumerate(zip(node.axes, names))
                           if n and axis not in keep)

    pairs = jax.tree_util.tree_map_with_path(entry, experts)
    is_pair = lambda v: isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], PartitionSpec)  # noqa: E731
    return (jax.tree.map(lambda v: v[0], pairs, is_leaf=is_pair),
            jax.tree.map(lambda v: v[1], pairs, is_leaf=is_pair))


def _gathered(experts: dict, gathers, dtype) -> dict:
    """The expert weights inside the region, gathered as `_expert_inputs` says. Float weights
    that no quantization touches are cast to the compute dtype first, as every product casts
    them (projection.weight): the gather then moves half the bytes, and its transpose
    reduce-scatters the gradient in that dtype, as the partitioner does for the dense layers'
    weights."""
    plain = not active_config().quantizes_weights

    def one(leaf, gather):
        if gather and plain and jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf.astype(dtype)
        for dim, names in gather:
            leaf = jax.lax.all_gather(leaf, names, axis=dim, tiled=True)
        return leaf

    return jax.tree.map(one, experts, gathers)


class _ExpertParallel(NamedTuple):
    mesh: object
    batch_spec: PartitionSpec
    expert_names: tuple[str, ...]
    hidden_names: tuple[str, ...]
    batch_names: tuple[str, ...]
    split_names: tuple[str, ...]  # expert axes that do not split the batch: they split each shard's tokens


def _manual_layout(moe: MoE, x: jax.Array, rules, mesh):
    """(batch spec, mesh axes of the experts, of the hidden units, of the batch) for a region
    manual over every mesh axis."""
    batch_spec = partition_spec(("batch", None, None), rules, mesh)
    expert_specs = _expert_specs(moe, x.shape[-1], rules, mesh)
    up_spec = expert_specs["up"]["kernel"]  # [experts, embed, mlp]
    return (batch_spec, _names_of(up_spec[0]), _names_of(up_spec[2]),
            _names_of(batch_spec[0]))


def _expert_parallel_layout(moe: MoE, x: jax.Array) -> _ExpertParallel | None:
    """How the dropless path runs with the experts split over mesh axes (expert_dispatch.py), or
    None when the active rules do not split the experts or the shapes do not divide."""
    active = active_rules()
    if active is None:
        return None
    mesh, rules = active
    batch_spec, expert_names, hidden_names, batch_names = _manual_layout(moe, x, rules, mesh)
    split_names = tuple(n for n in expert_names if n not in batch_names)
    size = lambda names: math.prod(mesh.shape[n] for n in names)  # noqa: E731
    if not expert_names or set(hidden_names) & set(batch_names) or x.shape[0] % size(batch_names):
        return None
    if (x.shape[0] // size(batch_names) * x.shape[1]) % size(split_names):
        return None
    return _ExpertParallel(mesh, batch_spec, expert_names, hidden_names, batch_names, split_names)


def _routed_expert_parallel(moe: MoE, params: dict, x: jax.Array, config: MoEConfig,
                            layout: _ExpertParallel) -> tuple[jax.Array, MoEStats]:
    """The dropless path with tokens sent to their experts' devices (expert_dispatch.py), manual
    over every mesh axis. Expert axes that do not split the batch split each shard's tokens
    instead, so that every device routes distinct tokens; the outputs are gathered back."""
    mesh = layout.mesh
    shards = math.prod(mesh.shape[n] for n in layout.expert_names)
    summed = layout.batch_names + layout.split_names
    total = (lambda v: jax.lax.psum(v, summed)) if summed else (lambda v: v)
    # Inside, the active mesh is abstract: the body keeps the lowering choices of the mesh outside.
    choices = lowering_choices()

    def path(moe, params, tokens, routing, config, batch):
        plan = DispatchPlan(layout.expert_names, shards, layout.hidden_names,
                            _shard_index(layout.expert_names, mesh))
        with use_lowering(choices):
            y = dispatch_experts(moe, params, tokens, routing.experts, routing.weights, plan)
        return y, jnp.zeros((), jnp.float32)

    weight_specs, gathers = _expert_inputs(params["experts"], moe, x.shape[-1], frozenset(mesh.axis_names),
                                           keep=("experts", "mlp"))

    def per_device(p, x):
        p = {**p, "experts": _gathered(p["experts"], gathers, x.dtype)}
        batch, seq, d_model = x.shape
        tokens = x.reshape(1, batch * seq, d_model)
        if layout.split_names:
            share = batch * seq // math.prod(mesh.shape[n] for n in layout.split_names)
            start = _shard_index(layout.split_names, mesh) * share
            tokens = jax.lax.dynamic_slice_in_dim(tokens, start, share, axis=1)
        y, stats = _routed(moe, p, tokens, config, total=total, path=path)
        if layout.split_names:
            y = jax.lax.all_gather(y, layout.split_names, axis=1, tiled=True)
        return y.reshape(batch, seq, d_model), stats

    param_specs = {"router": jax.tree.map(lambda _: PartitionSpec(), params["router"]),
                   "experts": weight_specs}
    # check_vma off: as for the batch shards in moe_layer (XLA:CPU's compiler crashes on the
    # gradient of such a region inside the scanned layers).
    return jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs, layout.batch_spec),
                         out_specs=(layout.batch_spec, PartitionSpec()), axis_names=frozenset(mesh.axis_names),
                         check_vma=False)(params, x)


# ---------------------------------------------------------------- statistics over the model

def mean_aux_loss(stats: list) -> jax.Array:
    """The load-balancing loss averaged over every MoE layer; stats is model.forward_with_aux's
    per-segment, per-block list (None for dense blocks). 0 for a model without MoE layers."""
    losses = [s.aux_loss.reshape(-1) for segment in stats for s in segment if s is not None]
    if not losses:
        return jnp.zeros((), jnp.float32)
    return jnp.mean(jnp.concatenate(losses))


def expert_loads(stats: list) -> list:
    """The same nesting with each MoE block's [layers, experts] load (None for dense blocks)."""
    return [[None if s is None else s.expert_load for s in segment] for segment in stats]


def update_correction_biases(spec: ModelSpec, params: dict, loads: list, rate: float) -> dict:
    """DeepSeek V3's auxiliary-loss-free balancing (arXiv:2412.19437, §2.1.2): after each step,
    every correction bias moves by `rate` toward balance, down for an expert that took more than
    the mean load, up for one that took less. `loads` is expert_loads(...) summed over the step."""
    segments = []
    for s, segment in enumerate(spec.layers):
        blocks = []
        for p, name in enumerate(segment.period):
            layer = params["segments"][s][p]
            ffn = spec.blocks[name].mlp
            if isinstance(ffn, MoE) and ffn.router.correction_bias:
                load = loads[s][p]  # [layers, experts]
                step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
                bias = layer["mlp"]["router"]["correction_bias"]
                router = {**layer["mlp"]["router"], "correction_bias": (bias + step).astype(bias.dtype)}
                layer = {**layer, "mlp": {**layer["mlp"], "router": router}}
            blocks.append(layer)
        segments.append(blocks)
    return {**params, "segments": segments}


def has_correction_bias(spec: ModelSpec) -> bool:
    return any(isinstance(b.mlp, MoE) and b.mlp.router.correction_bias for b in spec.blocks.values())


def add_moe_terms(sums, stats: list, config: MoEConfig):
    """A batch's loss.LossSums with the load-balancing loss and the expert loads added. The loss
    joins as weight · (mean over MoE layers) · tokens, a sum over tokens like the cross entropy,
    so that dividing by the batch's token count gives the weighted loss itself."""
    aux = config.aux_loss_weight * mean_aux_loss(stats) * sums.tokens
    return sums._replace(aux_loss=sums.aux_loss + aux, expert_load=expert_loads(stats))
