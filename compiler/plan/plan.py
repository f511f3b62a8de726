"""The Plan: how one model trains on one topology, as a plain value that checks itself.

A Plan holds the mesh (axis sizes over stage, data, fsdp, context, expert, tensor; the part of
each that spans slices over the data-centre network), the logical→mesh rules, the remat policy,
the number of microbatches, the pipeline's layout where it has stages, and the attention
implementation; next to them, the evidence: the
per-device memory the planner predicts, what XLA reports after compiling the train step, the
estimated step time, the reasons for each choice and the candidates that lost. It is saved as
JSON and read back by `mxc compile --plan plan.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mxc.records import omit_at_default
from mxc.spec.ir import LOGICAL_AXES

# Pipeline stages (compiler/lower/pipeline.py splits the stage dimension over this mesh axis).
STAGE_AXIS = "stage"
# The mesh axes a plan sizes, in the order the device mesh is laid out: the last axis gets the
# closest physical neighbours, so the chattiest parallelism (tensor) goes last and the quietest
# (stage: one activation per microbatch and stage crosses it) first, where slices join.
MESH_AXES = (STAGE_AXIS, "data", "fsdp", "context", "expert", "tensor")
FORMAT_VERSION = 1

GIB = 2**30
OUT_OF_HBM = "XLA: out of HBM"  # how a verdict's reason starts when XLA refused for memory


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Memory(_Value):
    """Predicted bytes per device. Host bytes (offloaded activations) do not count toward HBM."""

    parameters: int
    optimizer_state: int
    gradients: int
    activations: int  # saved for the backward pass, all layers, one microbatch
    temporaries: int  # live only inside one layer's step, the logits, the update
    host: int = 0  # activations offloaded to host memory

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_state + self.gradients + self.activations + self.temporaries


class XlaMemory(_Value):
    """Bytes per device as XLA's memory analysis of the compiled train step reports them.

    XLA does not split its temporaries into gradients, activations and scratch; parameters and
    optimizer state are the train state's arguments, read off their shardings."""

    parameters: int
    optimizer_state: int
    batch: int  # the step's arguments besides the train state: this device's share of the tokens
    temporaries: int  # gradients, activations and scratch together
    outputs: int  # outputs not aliased to a donated argument
    generated_code: int
    host_temporaries: int = 0
    peak: int = 0  # XLA's own peak of live buffers, where it reports one

    @property
    def total(self) -> int:
        """XLA's peak; without one, every buffer at once (an upper bound). The arguments and the
        temporaries' block are live together, so a peak below them leaves the temporaries out (the
        CPU backend's does) and is raised to them, to compare like with like with the estimate.
        XLA's peak also counts host memory (offloaded activations), which HBM does not hold."""
        if self.peak:
            return max(self.peak - self.host_temporaries, self.parameters + self.optimizer_state + self.batch + self.temporaries)
        return (self.parameters + self.optimizer_state + self.batch + self.temporaries + self.outputs
                + self.generated_code)


class Verification(_Value):
    """What compiling the train step for the real topology said."""

    status: Literal["fits", "over_hbm", "rejected", "unavailable", "skipped"]
    reason: str = ""
    memory: XlaMemory | None = None
    compile_seconds: float | None = None
    # The step time estimated from the compiled program; the Plan's `time` shows it.
    time: "StepTime | None" = Field(default=None, exclude=True)

    @property
    def out_of_memory(self) -> bool:
        return self.status == "over_hbm" or (self.status == "rejected" and self.reason.startswith(OUT_OF_HBM))

    @property
    def readable(self) -> bool:
        """Whether the compiled program's estimate can rank the plan. One above the chip's peak
        (MFU over 1) cannot be a whole program's: the reader missed part of it (Llama 2 70B with
        AdamW's moments on host once read 0.82 s against 24.6 s by the formula)."""
        return self.time is not None and self.time.mfu <= 1


class StepTime(_Value):
    """Estimated time of one train step on one device, and what it buys."""

    compute_s: float  # compute-bound work (recomputation included) at the achieved matmul rate
    memory_s: float  # memory-bound work at the achieved HBM bandwidth
    communication_s: float  # all collectives, were none overlapped
    exposed_communication_s: float  # what is left after overlapping with compute
    step_s: float
    tokens_per_s: float  # the whole topology
    mfu: float  # model FLOPs (MaxText's accounting, no recomputation) / (step time x peak)
    tokens_per_s_per_device: float = 0.0
    bubble_fraction: float = 0.0  # the pipeline's idle share of the step (0 without stages)
    communication: dict[str, float] = {}  # seconds by collective kind
    # "compiled program": read off the HLO XLA compiled; "formula": the search's analytic pre-filter
    source: Literal["formula", "compiled program"] = "formula"


Verification.model_rebuild()


class Candidate(_Value):
    """A plan the search considered and did not choose."""

    mesh: dict[str, int]
    remat: str
    microbatches: int
    predicted_bytes: int
    step_s: float | None
    lost_because: str
    loss_chunks: int = 1  # the loss over pieces of the sequence (Lowering.loss_chunks)


def spec_hash(spec) -> str:
    """sha256 of the resolved spec's canonical JSON: the manifest's spec_hash, and a plan's."""
    from mxc.runtime.artifact import canonical_hash

    return canonical_hash(spec.model_dump(mode="json"))


class Lowering(_Value):
    """Choices of the lowering that depend on the target (compiler/lower/choices.py), kept in
    the plan so that the plan file alone decides the program."""

    stacked_projections: bool
    interpret_kernels: bool
    quantization: str = "fp32"  # compiler/lower/choices.py's; fp32 in plans saved before it was kept
    float32_logits_dot: bool = True  # compiler/lower/choices.py's; True in plans saved before it was kept
    loss_chunks: int = 1  # compiler/lower/choices.py's; 1 (the whole logits) in plans saved before it was kept
    optimizer_state_on_host: bool = False  # compiler/lower/choices.py's; False in plans saved before it was kept

    # A plan that keeps the optimizer state in HBM reads as before the choice existed.
    _omit = omit_at_default("optimizer_state_on_host")


class Pipeline(_Value):
    """The circular pipeline of a plan with stages (compiler/lower/pipeline.py's PipelineLayout):
    the model's largest segment of layers laid out [repeats, stages, layers per stage], the batch
    in `microbatches` (the plan's own: all of them go through the pipeline)."""

    stages: int
    microbatches: int
    repeats: int = 1
    segment: int = 0  # which of the spec's segments is pipelined
    layers: int = 0  # of that segment's layers, how many the pipeline runs (the rest after it)
    bubble_fraction: float = 0.0  # (stages - 1) / (microbatches x repeats + stages - 1)


class Plan(_Value):
    format_version: int = FORMAT_VERSION
    model: str
    spec_hash: str = ""  # of the spec planned for (see spec_hash()); "" in plans saved before it was kept
    topology: str
    slices: int = 1
    chips: int
    chip: str
    hbm_bytes: int
    seq: int
    batch: int  # global, in sequences
    mesh: dict[str, int]  # every axis of MESH_AXES, its whole size
    dcn: dict[str, int] = {}  # the factor of an axis that spans slices (product: slices)
    rules: dict[str, list[str]]  # logical axis -> mesh axes
    remat: str
    microbatches: int = 1
    pipeline: Pipeline | None = None  # with mesh.stage > 1
    attention: str = "xla"
    # MoE layers: mxc.compiler.lower.moe's expert path and capacity factor (None without experts)
    expert_path: str | None = None
    capacity_factor: float | None = None
    lowering: Lowering | None = None  # None in plans saved before it was kept: the chip's platform decides
    pins: dict[str, int] = {}
    fits: bool  # XLA says so; or, where XLA could not judge, the prediction does
    predicted: Memory
    # One device's KV cache for serving `batch` sequences of `seq` tokens on this mesh
    serving_kv_cache: int = 0
    xla: Verification
    time: StepTime | None = None
    reasons: list[str] = []
    advice: list[str] = []  # for a plan that does not fit: what would make it fit
    candidates: list[Candidate] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _stage_axis(cls, data):
        """Plans saved before the stage axis was recorded had none: one stage."""
        if isinstance(data, dict) and isinstance(data.get("mesh"), dict) and STAGE_AXIS not in data["mesh"]:
            data = {**data, "mesh": {**data["mesh"], STAGE_AXIS: 1}}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        stages = self.mesh.get(STAGE_AXIS, 1)
        if stages > 1 and (self.pipeline is None or self.pipeline.stages != stages
                           or self.pipeline.microbatches != self.microbatches):
            raise ValueError(f"mesh {STAGE_AXIS} {stages} needs a pipeline of {stages} stages over the plan's "
                             f"{self.microbatches} microbatches, not {self.pipeline}")
        if stages == 1 and self.pipeline is not None:
            raise ValueError(f"a pipeline of {self.pipeline.stages} stages needs mesh {STAGE_AXIS} {self.pipeline.stages}")
        unknown = sorted(set(self.mesh) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; a plan sizes {', '.join(MESH_AXES)}")
        if math.prod(self.mesh.values()) != self.chips:
            raise ValueError(f"mesh {self.mesh_text()} has {math.prod(self.mesh.values())} devices, "
                             f"the topology {self.chips}")
        if self.dcn and math.prod(self.dcn.values()) != self.slices:
            raise ValueError(f"the axes across slices ({self.dcn}) multiply to "
                             f"{math.prod(self.dcn.values())}, not {self.slices} slices")
        for axis, size in self.dcn.items():
            if self.mesh.get(axis, 1) % size:
                raise ValueError(f"{axis} spans {size} slices but has {self.mesh.get(axis, 1)} devices")
        for logical, targets in self.rules.items():
            if logical not in LOGICAL_AXES:
                raise ValueError(f"rule for unknown logical axis '{logical}'")
            bad = [t for t in targets if t not in MESH_AXES]
            if bad:
                raise ValueError(f"rule {logical} -> {bad}: not mesh axes of a plan")
        if self.batch % self.microbatches:
            raise ValueError(f"batch {self.batch} does not split into {self.microbatches} microbatches")
        return self

    # ---------------------------------------------------------------- the mesh, for compile

    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self.mesh.get(axis, 1) for axis in MESH_AXES)

    def ici_sizes(self) -> tuple[int, ...]:
        """Per-slice axis sizes (the mesh inside one slice)."""
        return tuple(self.mesh.get(axis, 1) // self.dcn.get(axis, 1) for axis in MESH_AXES)

    def dcn_sizes(self) -> tuple[int, ...]:
        return tuple(self.dcn.get(axis, 1) for axis in MESH_AXES)

    def pipeline_layout(self):
        """The lowering's PipelineLayout, or None without stages."""
        from mxc.compiler.lower.pipeline import PipelineLayout

        if self.pipeline is None:
            return None
        return PipelineLayout(self.pipeline.stages, self.pipeline.microbatches, self.pipeline.repeats)

    def moe_config(self):
        """The lowering's MoEConfig for this plan (its defaults where the model has no experts)."""
        from mxc.compiler.lower.moe import MoEConfig

        if self.expert_path is None:
            return MoEConfig()
        factor = {} if self.capacity_factor is None else {"capacity_factor": self.capacity_factor}
        return MoEConfig(path=self.expert_path, **factor)  # dropless plans record no factor

    def lowering_choices(self):
        """The choices the program's functions are traced under (mxc.compiler.lower.choices)."""
        from mxc.compiler.lower.choices import LoweringChoices
        from mxc.compiler.topology import CHIPS

        choices = LoweringChoices.for_chip(CHIPS[self.chip])
        return choices if self.lowering is None else choices.with_recorded(self.lowering.model_dump())

    def rules_tuples(self) -> dict[str, tuple[str, ...]]:
        """The rules in the form mxc.compiler.lower.sharding takes."""
        return {logical: tuple(targets) for logical, targets in self.rules.items()}

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> dict:
        # A plan without stages reads as before pipelines were planned (no "pipeline" key).
        return self.model_dump(mode="json", exclude={"pipeline"} if self.pipeline is None else None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        data = json.loads(Path(path).read_text())
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: plan format {version}, this mxc reads format {FORMAT_VERSION}")
        return cls.model_validate(data)

    # ---------------------------------------------------------------- text

    def mesh_text(self) -> str:
        used = [f"{axis} {self.mesh[axis]}" + (f" ({self.dcn[axis]} across slices)" if self.dcn.get(axis, 1) > 1 else "")
                for axis in MESH_AXES if self.mesh.get(axis, 1) > 1]
        return ", ".join(used) or "one device"

    def __str__(self) -> str:
        from mxc.compiler.plan.report import plan_text

        return plan_text(self)
