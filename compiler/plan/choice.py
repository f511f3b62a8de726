"""One point of the search: a mesh, its rules, a remat policy, a microbatch count, an attention
implementation, for one model, batch and sequence. Memory and cost are functions of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, TypeVar

from mxc.compiler.plan.layout import Parameters, shard_counts_cached
from mxc.compiler.plan.plan import MESH_AXES
from mxc.compiler.topology import Topology
from mxc.spec.ir import ModelSpec

T = TypeVar("T")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Results that depend on only part of a Choice (the layout, or the layout and the microbatch's
# shape), shared by the many choices of one search that differ in the rest. Each entry holds its
# spec, so the spec's id in the key stays unique.
_MEMO: dict[tuple, tuple[ModelSpec, object]] = {}


@dataclass(frozen=True)
class Choice:
    spec: ModelSpec
    params: Parameters
    topology: Topology
    mesh: dict[str, int]  # whole axis sizes
    dcn: dict[str, int]  # the part of each axis that spans slices
    rules: dict[str, tuple[str, ...]]
    seq: int
    batch: int
    microbatches: int
    remat: str
    attention: str
    rule_notes: tuple[str, ...] = field(default=(), compare=False)
    # MoE layers: the lowering's expert path and its capacity factor (None without experts)
    expert_path: str | None = None
    capacity_factor: float | None = None
    # The output head and loss over this many pieces of the sequence (LoweringChoices.loss_chunks)
    loss_chunks: int = 1
    # AdamW's moments in host memory between steps (LoweringChoices.optimizer_state_on_host)
    optimizer_on_host: bool = False

    def __hash__(self):
        return hash((self.spec.name, tuple(sorted(self.mesh.items())), tuple(sorted(self.dcn.items())),
                     self.seq, self.batch, self.microbatches, self.remat, self.attention, self.loss_chunks,
                     self.optimizer_on_host))

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.spec.param_dtype]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.spec.compute_dtype]

    @property
    def microbatch(self) -> int:
        """Sequences in one microbatch, over all devices."""
        return self.batch // self.microbatches

    @cached_property
    def _keys(self) -> tuple[tuple, tuple]:
        return (tuple(sorted((k, tuple(v)) for k, v in self.rules.items())), tuple(sorted(self.mesh.items())))

    def memo(self, what: str, compute: Callable[[], T], *, shapes: bool = False) -> T:
        """`compute()` once per layout (mesh and rules), or per layout and microbatch shape (with
        the paths that shape the intermediates: attention's and the experts')."""
        shape = (self.microbatch, self.seq, self.attention, self.expert_path, self.capacity_factor) if shapes else ()
        key = (what, id(self.spec), self._keys, shape)
        if key not in _MEMO:
            _MEMO[key] = (self.spec, compute())
        return _MEMO[key][1]

    def counts(self, axes: tuple) -> tuple[int, ...]:
        """Into how many pieces each dimension of an array with these logical axes is split."""
        return shard_counts_cached(tuple(axes), *self._keys)

    def split(self, logical: str) -> int:
        return self.counts((logical,))[0]

    @cached_property
    def local_tokens(self) -> int:
        """Tokens of one microbatch a device holds: its batch rows times its sequence piece."""
        return -(-self.microbatch // self.split("batch")) * -(-self.seq // self.split("seq"))

    def local(self, shape: tuple[int, ...], axes: tuple) -> int:
        """Elements of one device's piece (dimensions rounded up, as XLA pads uneven splits)."""
        return math.prod(-(-dim // count) for dim, count in zip(shape, self.counts(axes)))

    def gather_factor(self, axes: tuple) -> int:
        """How many devices hold pieces of a parameter that the layer needs whole: the axes that
        split it only to save memory (everything but tensor and expert, which split the work)."""
        return math.prod(count for axis, count in zip(axes, self.counts(axes))
                         if axis not in ("heads", "kv_heads", "mlp", "vocab", "experts"))

    def mesh_key(self) -> tuple[int, ...]:
        return tuple(self.mesh.get(axis, 1) for axis in MESH_AXES)


_LAYER_COUNTS: dict[int, tuple[ModelSpec, dict[str, int]]] = {}


def layer_counts(spec: ModelSpec) -> dict[str, int]:
    """How many layers of each block kind the model has."""
    if id(spec) not in _LAYER_COUNTS:
        counts: dict[str, int] = {}
        for name in spec.layer_kinds:
            counts[name] = counts.get(name, 0) + 1
        _LAYER_COUNTS[id(spec)] = (spec, counts)
    return _LAYER_COUNTS[id(spec)][1]
