"""The artifact format: what `manifest.json` holds, as typed values the compiler writes and the
runtime reads.

An artifact is a directory:

    manifest.json           this schema (every other file listed in `files` with its sha256,
                            and in `file_sizes` with its size in bytes)
    <function>.executable   the native executable, as PJRT serialises it (raw bytes, no pickle)
    <function>.stablehlo    the portable export (jax.export's flatbuffer), for recompiling when
                            the library versions on the running host differ

Pytrees never travel as Python objects. Every function takes and returns a flat list of arrays;
each leaf records its path in the caller's tree (`["state", "params", "embed", "embedding"]`:
names for mapping keys and attributes, integers for sequence positions), its shape, dtype and
PartitionSpec over the topology's mesh. Loading rebuilds nested dicts and lists from the paths,
so nothing from the artifact is ever executed as Python.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from mxc.runtime.file_names import plain_name
from mxc.records import omit_at_default

# 2: `compiler_options`, the options XLA compiled every function with.
# 3: `file_sizes`, so a listed file is read only up to its recorded size.
# 4: train_step takes a third argument, `schedule` ({"learning_rate": float32 scalar}), computed
#    by the runtime every step; older train steps baked their schedule in.
FORMAT_VERSION = 4
MANIFEST_NAME = "manifest.json"

# A file of the artifact: a plain name inside its folder, so no manifest can name a file elsewhere.
FileName = Annotated[str, AfterValidator(lambda name: plain_name(name, MANIFEST_NAME))]
PathEntry = Union[str, int]  # a mapping key or attribute name; an index into a sequence
ShardingEntry = Union[None, str, list[str]]  # one PartitionSpec entry: replicated, one mesh axis, several


class _Record(BaseModel):
    # Unknown keys are refused: a manifest this runtime does not fully understand is not run.
    model_config = ConfigDict(frozen=True, extra="forbid")


class Leaf(_Record):
    """One array a function takes or returns."""

    path: list[PathEntry]
    shape: list[NonNegativeInt]
    dtype: str
    sharding: list[ShardingEntry]  # a PartitionSpec over `topology.mesh`, one entry per dimension
    donated: bool = False  # inputs only: the function consumes this buffer
    # Where the array lives between calls: "pinned_host" for a plan's optimizer state kept in host
    # memory (the executable takes and returns it there). Left out of the manifest for "device",
    # so manifests without host-memory leaves read as before.
    memory_kind: Literal["device", "pinned_host"] = "device"

    _omit = omit_at_default("memory_kind")

    @property
    def name(self) -> str:
        return path_name(self.path)


class Memory(_Record):
    """Bytes per device, as XLA's memory analysis of the compiled executable reports them."""

    argument_bytes: NonNegativeInt
    output_bytes: NonNegativeInt
    alias_bytes: NonNegativeInt  # outputs that reuse donated argument buffers
    temp_bytes: NonNegativeInt
    generated_code_bytes: NonNegativeInt
    # argument + output - alias + temp: what the function needs resident at its peak.
    total_bytes: NonNegativeInt


class Cost(_Record):
    """XLA's cost analysis, per device. A scan's body is counted once, not once per iteration,
    and GPU compilers report nothing (None); `Estimate` holds the analytic count."""

    flops: float | None
    bytes_accessed: float | None


class Function(_Record):
    name: str
    arguments: list[str]  # names of the positional arguments; a leaf's path starts with its index
    executable: FileName  # the native executable
    export: FileName  # the StableHLO export
    inputs: list[Leaf]
    outputs: list[Leaf]
    donation: list[NonNegativeInt]  # indices of the donated arguments
    memory: Memory
    cost: Cost
    # Time of each compile stage (lower, compile, export), wall clock and CPU ("compile_cpu").
    seconds: dict[str, float] = {}


class Topology(_Record):
    """The devices the executables were compiled for; loading checks the live ones against it."""

    name: str  # as the user gave it (v5p-1024, cpu-8, ...)
    platform: Literal["tpu", "gpu", "cpu"]
    chip: str
    device_kind: str  # as the devices report it ("TPU v5", "cpu", "NVIDIA H100 80GB HBM3")
    chips: PositiveInt
    devices: PositiveInt
    slices: PositiveInt = 1
    hosts: PositiveInt = 1
    hbm_bytes: NonNegativeInt  # per chip
    usable_hbm_bytes: NonNegativeInt | None = None  # what one program may use, per chip
    shape: list[PositiveInt]  # the physical slice shape (TPU), or [devices]
    mesh: dict[str, PositiveInt]  # mesh axis -> size, in mesh order
    device_ids: list[NonNegativeInt]  # the mesh's devices in row-major order
    device_coords: list[list[int]] | None = None  # physical coordinates, per entry of device_ids


class Versions(_Record):
    jax: str
    jaxlib: str
    libtpu: str | None
    cuda_plugin: str | None = None
    mxc: str


class Estimate(_Record):
    """Analytic figures for one train step (XLA's cost analysis undercounts scanned layers)."""

    tokens_per_step: PositiveInt
    train_flops_per_step: float  # whole step, all devices
    flops_per_device: float
    peak_flops_per_device: float
    step_seconds_at_peak: float  # compute-bound lower bound
    step_seconds: float | None = None  # the planner's estimate, where a plan gives one


class Manifest(_Record):
    format_version: int
    model: str
    spec: dict  # the resolved IR, as JSON
    spec_hash: str  # sha256 of the canonical JSON of `spec`
    plan: dict
    run: dict  # seq, batch, serving sizes, optimizer: what the functions were built for
    topology: Topology
    versions: Versions
    functions: dict[str, Function]
    files: dict[FileName, str]  # file name -> sha256 hex, every file but the manifest
    file_sizes: dict[FileName, NonNegativeInt] = {}  # file name -> size in bytes, the same files
    estimate: Estimate | None = None
    # XLA options beyond its defaults that every function was compiled with (mxc.compiler.xla_options);
    # a recompile from the StableHLO exports passes them again.
    compiler_options: dict[str, Union[bool, int, float, str]] = {}
    compile_seconds: float = 0.0
    created: str = ""  # ISO 8601, UTC
    # sha256 of this manifest's canonical JSON without this field: the manifest describes how
    # the executables are called (shapes, shardings), so an edit to it must be caught as surely
    # as an edit to an executable.
    manifest_sha256: str = ""

    def sealed(self) -> "Manifest":
        return self.model_copy(update={"manifest_sha256": manifest_digest(self.model_dump(mode="json"))})

    def to_json_text(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"


def manifest_digest(data: dict) -> str:
    return canonical_hash({key: value for key, value in data.items() if key != "manifest_sha256"})


def path_name(path: list[PathEntry]) -> str:
    """`["state", "params", "segments", 0, 0, "mlp"]` -> `state.params.segments[0][0].mlp`."""
    text = ""
    for entry in path:
        text += f"[{entry}]" if isinstance(entry, int) else (f".{entry}" if text else entry)
    return text


def canonical_hash(value) -> str:
    """sha256 of a JSON value with sorted keys and no whitespace: equal values, equal hashes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArtifactError(Exception):
    """The artifact cannot be run here; the message says what was expected and what was found."""


class ArtifactFormatField(BaseModel):
    """Only the format version, read before anything else: a newer format may change the rest."""

    model_config = ConfigDict(extra="ignore")
    format_version: int = Field(strict=True)
