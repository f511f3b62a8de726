"""Two layouts of a model's layer parameters: stacked, and one array per layer (serving on CPUs).

Checkpoints, training and TPU programs keep each segment's layers stacked:

    params["segments"][s] = [tree of block p with leaves [layers, ...] for p in period]

and the forward pass scans over the stack. On a CPU, a decode step's scan first copies every
layer's kernels out of the stacked arrays before its products read them (43% of a 27 ms
SmolLM2-135M float32 decode step, docs/runtime.md). Serving programs for CPU topologies take the
layers apart instead,

    params["segments"][s] = [[tree of block p, leaves [...], for p in period] for each layer]

and model.run_segment runs them one after another: the products read the weights where they
lie. The runtime converts a restored checkpoint once, when serving starts (`per_layer_arrays`,
the one conversion); the checkpoint on disk keeps its stacked layout, so one checkpoint serves both.

Where the lowering choice joined_serving_projections is on (CPUs), that conversion also joins each
layer's projections of one input into one kernel, stored once:

    block["attention"]["qkv"] = {"kernel": [embed, heads + 2 kv_heads, head_dim], "bias"?}  # q|k|v
    block["mlp"]["gate_up"] = {"kernel": [embed, 2 mlp], "bias"?}                            # gate|up

so a decode step runs one product where it ran three and two (attention.py and ffn.py split its
output). Float kernels only (serving quantized weights stays stacked); biases (Qwen's q/k/v) are
joined the same way; cross-attention layers (whose keys come from the images) keep theirs apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def is_per_layer(segment_params: list) -> bool:
    """True for one segment's parameters laid out per layer (a list of layers, each a list of
    period blocks); False for the stacked layout (a list of period blocks)."""
    return bool(segment_params) and isinstance(segment_params[0], list)


def _layers(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


# (the block's entry, the joined projection's name, the projections it joins, in order)
JOINED = (("attention", "qkv", ("q", "k", "v")), ("mlp", "gate_up", ("gate", "up")))


def _joinable(entry: str, owner: dict, names: tuple[str, ...]) -> bool:
    if "attention_gate" in owner or not all(isinstance(owner.get(name), dict) for name in names):
        return False  # a cross-attention layer (cross_attention.py), or not these projections
    if entry == "attention" and len(getattr(owner.get("o", {}).get("kernel"), "shape", ())) != 3:
        return False  # the output kernel's heads say where the query's part ends (_part_sizes)
    parts = [owner[name] for name in names]
    if any(set(part) not in ({"kernel"}, {"kernel", "bias"}) or set(part) != set(parts[0]) for part in parts):
        return False  # quantized (scales), or biases on some parts only
    kernels = [part["kernel"] for part in parts]
    shape, dtype = kernels[0].shape, kernels[0].dtype
    return len(shape) == (3 if entry == "attention" else 2) and all(
        k.dtype == dtype and k.shape[0] == shape[0] and k.shape[2:] == shape[2:] for k in kernels)


def _joins(block: dict) -> list[tuple[str, str, tuple[str, ...]]]:
    """The JOINED rows that apply to one layer's block (of arrays or ShapeDtypeStructs)."""
    return [(entry, name, names) for entry, name, names in JOINED
            if isinstance(block.get(entry), dict) and _joinable(entry, block[entry], names)]


def joined_block(block: dict, join=lambda parts, axis: jnp.concatenate(parts, axis), joins=None) -> dict:
    """One layer's block with its projections of one input joined (JOINED): kernels along axis 1,
    biases along axis 0. `join(parts, axis)`: how (the default concatenates arrays); `joins`: the
    rows to apply (default: those that apply to `block`)."""
    for entry, name, names in _joins(block) if joins is None else joins:
        owner = block[entry]
        parts = [owner[part] for part in names]
        joined = {key: join([part[key] for part in parts], 1 if key == "kernel" else 0) for key in parts[0]}
        block = {**block, entry: {**{k: v for k, v in owner.items() if k not in names}, name: joined}}
    return block


def _part_sizes(entry: str, owner: dict, total: int) -> tuple[int, ...]:
    if entry == "attention":  # q has the output's heads; k and v share the rest
        heads = owner["o"]["kernel"].shape[0]
        return heads, (total - heads) // 2, (total - heads) // 2
    return total // 2, total // 2


def split_block_abstract(block: dict) -> dict:
    """joined_block undone on one layer's ShapeDtypeStructs (each part keeps the joined sharding)."""
    for entry, name, names in JOINED:
        owner = block.get(entry)
        if not isinstance(owner, dict) or name not in owner:
            continue
        joined = owner[name]
        sizes = _part_sizes(entry, owner, joined["kernel"].shape[1])

        def part(leaf, size, axis):
            shape = leaf.shape[:axis] + (size,) + leaf.shape[axis + 1:]
            return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))

        parts = {part_name: {key: part(leaf, size, 1 if key == "kernel" else 0) for key, leaf in joined.items()}
                 for part_name, size in zip(names, sizes)}
        block = {**block, entry: {**{k: v for k, v in owner.items() if k != name}, **parts}}
    return block


def has_joined(tree: dict) -> bool:
    """Whether a per-layer parameter tree (or a tree of its shardings) holds joined projections."""
    return any(isinstance(block.get(entry), dict) and name in block[entry]
               for segment in tree["segments"] if is_per_layer(segment) for layer in segment for block in layer
               for entry, name, _ in JOINED)


def per_layer(params: dict, joined: bool = False) -> dict:
    """Stacked parameters (arrays, numpy or jax) -> one tree per layer (each layer's projections
    joined where `joined`); unchanged if already so."""
    segments = []
    for segment in params["segments"]:
        if is_per_layer(segment):
            segments.append(segment)
            continue
        layers = [[jax.tree.map(lambda a, i=i: a[i], block) for block in segment] for i in range(_layers(segment))]
        segments.append([[joined_block(block) for block in layer] for layer in layers] if joined else layers)
    return {**params, "segments": segments}


def _unstacked_struct(leaf: jax.ShapeDtypeStruct, layer_sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=layer_sharding)


def _layer_sharding(sharding):
    """A stacked array's sharding without its leading layers axis."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def _unsplit_along_axis_1(sharding) -> bool:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return len(spec) < 2 or spec[1] is None


def _joins_split_parts(shapes: dict, shardings: dict) -> bool:
    """Whether a mesh axis splits the axis some joinable projections of a layer would join along
    (their shards would no longer line up with their parts): then no layer's are joined, so that
    the arrays' conversion (per_layer, which follows has_joined) makes the same tree."""
    return any(not _unsplit_along_axis_1(shardings[entry][part].get("kernel"))
               for entry, _, names in _joins(shapes) for part in names)


def _joined_abstract(shapes: dict, shardings: dict) -> tuple[dict, dict]:
    """joined_block on one layer's ShapeDtypeStructs and shardings."""
    def struct(parts, axis):
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        return jax.ShapeDtypeStruct(tuple(shape), parts[0].dtype, sharding=parts[0].sharding)

    joins = _joins(shapes)
    return joined_block(shapes, struct, joins), joined_block(shardings, lambda parts, axis: parts[0], joins)


def per_layer_abstract(shapes: dict, shardings: dict, joined: bool = False) -> tuple[dict, dict]:
    """ShapeDtypeStructs and shardings of stacked parameters -> those of the per-layer layout (each
    layer's projections joined where `joined`, as per_layer joins them)."""
    segments, segment_shardings = [], []
    layouts = []
    for segment, segment_sharding in zip(shapes["segments"], shardings["segments"]):
        layer_shardings = [jax.tree.map(_layer_sharding, block) for block in segment_sharding]
        layer_shapes = [jax.tree.map(lambda leaf, sharding: _unstacked_struct(leaf, sharding), block, sharding)
                        for block, sharding in zip(segment, layer_shardings)]
        layouts.append((_layers(segment), layer_shapes, layer_shardings))
    joined = joined and not any(_joins_split_parts(block, sharding) for _, layer_shapes, layer_shardings in layouts
                                for block, sharding in zip(layer_shapes, layer_shardings))
    for count, layer_shapes, layer_shardings in layouts:
        if joined:
            pairs = [_joined_abstract(block, sharding) for block, sharding in zip(layer_shapes, layer_shardings)]
            layer_shapes, layer_shardings = [p[0] for p in pairs], [p[1] for p in pairs]
        segments.append([layer_shapes for _ in range(count)])
        segment_shardings.append([layer_shardings for _ in range(count)])
    return {**shapes, "segments": segments}, {**shardings, "segments": segment_shardings}


def stacked_abstract(shapes: dict) -> dict:
    """ShapeDtypeStructs of per-layer parameters -> those of the stacked layout (what a checkpoint
    restores to), with the first layer's sharding extended by an unsplit layers axis and joined
    projections split again."""
    segments = []
    for segment in shapes["segments"]:
        if not is_per_layer(segment):
            segments.append(segment)
            continue

        def stacked(leaf, count=len(segment)):
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding):
                sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *tuple(sharding.spec)))
            return jax.ShapeDtypeStruct((count, *leaf.shape), leaf.dtype, sharding=sharding)

        segments.append([jax.tree.map(stacked, split_block_abstract(block)) for block in segment[0]])
    return {**shapes, "segments": segments}


def all_per_layer(params: dict) -> bool:
    return all(is_per_layer(segment) for segment in params["segments"] if segment)


_per_layer_jitted = jax.jit(per_layer, static_argnums=1)


def per_layer_arrays(params: dict, shardings=None) -> dict:
    """A restored checkpoint's stacked arrays -> new arrays one per layer, by one compiled program
    (one copy of the weights), placed with `shardings` (a tree of the per-layer layout, an
    executable's own) where given; parameters already per layer come back as they are. The
    projections are joined as `shardings` has them, or without shardings where the lowering
    choice joined_serving_projections is on. This is
    the one conversion: an artifact's functions (program.BoundFunction.params_as_taken) and
    `mxc generate MODEL` both call it, and nothing here keeps the stacked or the split copy."""
    if all_per_layer(params):
        return params
    if shardings is not None:
        joined = has_joined(shardings)
    else:  # `mxc generate MODEL`, which traces the spec: the compiler is loaded already
        from mxc.compiler.lower.choices import lowering_choices

        joined = lowering_choices().joined_serving_projections
    split = _per_layer_jitted(params, joined)
    return split if shardings is None else jax.device_put(split, shardings)
