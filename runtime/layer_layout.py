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
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def is_per_layer(segment_params: list) -> bool:
    """True for one segment's parameters laid out per layer (a list of layers, each a list of
    period blocks); False for the stacked layout (a list of period blocks)."""
    return bool(segment_params) and isinstance(segment_params[0], list)


def _layers(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def per_layer(params: dict) -> dict:
    """Stacked parameters (arrays, numpy or jax) -> one tree per layer; unchanged if already so."""
    segments = []
    for segment in params["segments"]:
        if is_per_layer(segment):
            segments.append(segment)
            continue
        segments.append([[jax.tree.map(lambda a, i=i: a[i], block) for block in segment]
                         for i in range(_layers(segment))])
    return {**params, "segments": segments}


def _unstacked_struct(leaf: jax.ShapeDtypeStruct, layer_sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=layer_sharding)


def _layer_sharding(sharding):
    """A stacked array's sharding without its leading layers axis."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def per_layer_abstract(shapes: dict, shardings: dict) -> tuple[dict, dict]:
    """ShapeDtypeStructs and shardings of stacked parameters -> those of the per-layer layout."""
    segments, segment_shardings = [], []
    for segment, segment_sharding in zip(shapes["segments"], shardings["segments"]):
        count = _layers(segment)
        layer_shardings = [jax.tree.map(_layer_sharding, block) for block in segment_sharding]
        layer_shapes = [jax.tree.map(lambda leaf, sharding: _unstacked_struct(leaf, sharding), block, sharding)
                        for block, sharding in zip(segment, layer_shardings)]
        segments.append([layer_shapes for _ in range(count)])
        segment_shardings.append([layer_shardings for _ in range(count)])
    return {**shapes, "segments": segments}, {**shardings, "segments": segment_shardings}


def stacked_abstract(shapes: dict) -> dict:
    """ShapeDtypeStructs of per-layer parameters -> those of the stacked layout (what a checkpoint
    restores to), with the first layer's sharding extended by an unsplit layers axis."""
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

        segments.append([jax.tree.map(stacked, block) for block in segment[0]])
    return {**shapes, "segments": segments}


def all_per_layer(params: dict) -> bool:
    return all(is_per_layer(segment) for segment in params["segments"] if segment)


_per_layer_jitted = jax.jit(per_layer)


def per_layer_arrays(params: dict, shardings=None) -> dict:
    """A restored checkpoint's stacked arrays -> new arrays one per layer, by one compiled program
    (one copy of the weights), placed with `shardings` (a tree of the per-layer layout, an
    executable's own) where given; parameters already per layer come back as they are. This is
    the one conversion: an artifact's functions (program.BoundFunction.params_as_taken) and
    `mxc generate MODEL` both call it, and nothing here keeps the stacked or the split copy."""
    if all_per_layer(params):
        return params
    split = _per_layer_jitted(params)
    return split if shardings is None else jax.device_put(split, shardings)
