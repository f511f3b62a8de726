"""What the training loop needs from a program, and how a loaded artifact provides it.

The loop sees a `Trainable`: init / train_step / eval_step as plain calls on sharded arrays, the
train state's target layout (for restoring checkpoints onto this mesh), the batch layout the
compiled steps take, and the FLOP figures for MFU. `from_program` reads all of it off an
artifact's manifest; tests build one from jitted functions to check the loop on its own.

The train state is a dict {"step", "params", "opt_state"}, as the artifact's leaf paths give it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from mxc.runtime.artifact import ArtifactError
from mxc.runtime.data import BATCH_KEYS, BatchLayout, ImageLayout

TRAIN_FUNCTION, EVAL_FUNCTION, INIT_FUNCTION = "train_step", "eval_step", "init"


@dataclass(frozen=True)
class Trainable:
    init: Callable[[int], dict]  # seed -> train state
    train_step: Callable[[dict, dict], tuple[dict, dict]]  # (state, batch) -> (state, metrics)
    eval_step: Callable[[object, dict], dict] | None  # (params, batch) -> metrics
    abstract_state: dict  # the train state as ShapeDtypeStructs with this mesh's shardings
    layout: BatchLayout  # of train_step's batch
    eval_layout: BatchLayout | None
    vocab_size: int | None = None
    flops_per_step: float | None = None  # the model's FLOPs for one train step, all devices
    peak_flops: float | None = None  # the whole mesh's peak FLOP/s
    identity: dict = field(default_factory=dict)  # model, spec hash, topology: recorded in checkpoints


def _leaves(function, argument: int):
    """(path within the argument, leaf, sharding) of one positional argument's inputs."""
    for leaf, sharding in zip(function.function.inputs, function.in_shardings):
        if leaf.path[0] == argument:
            yield leaf.path[1:], leaf, sharding


def abstract_argument(function, argument: int):
    from mxc.runtime.tree_paths import build_tree

    paths, structs = [], []
    for path, leaf, sharding in _leaves(function, argument):
        paths.append(path)
        structs.append(jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype), sharding=sharding))
    return build_tree(paths, structs)


def _batch_layout(function, argument: int) -> BatchLayout:
    found = {path[0]: (leaf, sharding) for path, leaf, sharding in _leaves(function, argument)}
    missing = set(BATCH_KEYS) - set(found)
    if missing:
        raise ArtifactError(f"{function.name}'s batch has no {', '.join(sorted(missing))}; "
                            f"compile the artifact again with this mxc")
    leaf, sharding = found["inputs"]
    batch, seq = leaf.shape
    images = None
    if "pixel_values" in found:  # a vision model's image slots: [batch, slots, channels, height, width]
        pixels, pixel_sharding = found["pixel_values"]
        images = ImageLayout(pixels.shape[1], tuple(pixels.shape[2:]), pixel_sharding, found["image_mask"][1])
    return BatchLayout(batch, seq, sharding, np.dtype(found["mask"][0].dtype), images)


def from_program(program) -> Trainable:
    """A Trainable over a loaded artifact (mxc.runtime.load)."""
    manifest = program.manifest
    functions = program.functions
    for name in (INIT_FUNCTION, TRAIN_FUNCTION):
        if name not in functions:
            raise ArtifactError(f"{program.directory} has no {name} function: it cannot train")
    train = functions[TRAIN_FUNCTION]
    evaluate = functions.get(EVAL_FUNCTION)
    estimate = manifest.estimate
    return Trainable(
        init=functions[INIT_FUNCTION],
        train_step=train,
        eval_step=evaluate,
        abstract_state=abstract_argument(train, 0),
        layout=_batch_layout(train, 1),
        eval_layout=None if evaluate is None else _batch_layout(evaluate, 1),
        vocab_size=manifest.spec.get("vocab"),
        flops_per_step=None if estimate is None else estimate.train_flops_per_step,
        peak_flops=None if estimate is None else estimate.peak_flops_per_device * manifest.topology.devices,
        identity=artifact_identity(manifest))


def artifact_identity(manifest) -> dict:
    """What a checkpoint records of the artifact that trained it: model, spec hash, topology.
    Restoring compares the spec hash (runtime.checkpoint.check_same_spec)."""
    return {"model": manifest.model, "spec_hash": manifest.spec_hash, "topology": manifest.topology.name,
            "mesh": dict(manifest.topology.mesh)}
