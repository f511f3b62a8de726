"""Hardware topologies: one table of chip facts and one parser of names.

Names follow Google Cloud: `v5p-N` and `v4-N` count TensorCores (chips = N/2), `v5e-N` (alias
`v5litepod-N`) and `v6e-N` count chips. `cpu-N` is N virtual devices of the host CPU, `local`
whatever devices are attached, `h100-8` / `h200-8` one 8-GPU host (`h100-8x4`: four hosts).
Several TPU slices are joined over the data-centre network with `slices`.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import sys
from dataclasses import asdict, dataclass

from mxc.compiler.commands.units import size_bytes

GB = 1e9
MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # "tpu", "gpu" or "cpu"
    peak_bf16_flops: float  # per chip, dense
    hbm_bytes: int  # per chip
    hbm_bandwidth: float  # bytes/s per chip
    ici_bandwidth: float  # bytes/s per chip, bidirectional, over all its links (NVLink on GPUs)
    ici_links: int  # links per chip (4: 2D torus, 6: 3D torus)
    dcn_bandwidth: float  # bytes/s per chip towards other slices or hosts
    chips_per_host: int
    cores_per_chip: int  # TensorCores a Cloud TPU name counts (v4, v5p: 2)
    name_counts: str  # "cores" or "chips": what N in `gen-N` counts
    libtpu_name: str | None  # the generation as libtpu spells it in `gen:AxBxC`
    torus_dims: int  # 2 or 3; 0 where there is no torus
    # libtpu's chip configuration: "megacore" joins a chip's two TensorCores into one device
    # (how v4 and v5p train); "default" is one device per core.
    chip_config: str = "default"
    # Wraparound links: a 3D slice made of whole 4x4x4 cubes closes every axis into a ring (the
    # optical switches join the cube faces); a 2D slice closes an axis that spans the full pod
    # edge. Without them XLA cannot use its torus collectives and falls back to slower ones
    # (an all-gather becomes an all-reduce of zero-padded buffers).
    wrap_unit: int = 0  # 3D: every side a multiple of this; 2D: a side of exactly this
    # The most chips one slice (one ICI domain) may hold; larger names are several slices.
    max_slice_chips: int = 0
    # The side of the chip's systolic matrix units (MXUs): an operand dimension is padded to a
    # multiple of it (0: no systolic array, nothing padded). 128 up to v5p, 256 on v6e (JAX's
    # scaling book, "How to Think About TPUs": "TPU v6e (Trillium) has a 256x256 MXU, while all
    # previous generations use 128x128").
    mxu_width: int = 0
    # VMEM a Pallas kernel may take when it sets no limit of its own (libtpu's scoped VMEM
    # limit), as libtpu 0.0.52 states it when refusing a larger kernel: "Scoped allocation with
    # size 18.00M and limit 16.00M" on v5e, v5p ("vmem capacity" on v4), 32.00M on v6e. 0: none.
    kernel_vmem_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


# Sources: Google Cloud TPU system-architecture pages (v4, v5e, v5p, v6e), NVIDIA H100/H200
# datasheets (SXM). DCN per chip: the host's NICs divided among its chips.
# Largest slice (max_slice_chips), from the same pages: a v4 pod is 4096 chips
# (cloud.google.com/tpu/docs/v4); a v5e pod 256 chips, 16x16 (cloud.google.com/tpu/docs/v5e);
# a v5p pod 8960 chips, "the largest job that can be scheduled is a 96 cube (6144 chip) job",
# 16x16x24 (cloud.google.com/tpu/docs/v5p); a v6e pod 256 chips, 16x16
# (cloud.google.com/tpu/docs/v6e).
CHIPS: dict[str, Chip] = {
    # v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; 3D torus, six ICI links of 50 GB/s each
    # way; hosts of 4 chips.
    "v4": Chip("v4", "tpu", 275e12, 32 * GIB, 1200 * GB, 600 * GB, 6, 100e9 / 8 / 4, 4, 2, "cores",
               "v4", 3, "megacore", 4, max_slice_chips=4096, mxu_width=128,
               kernel_vmem_bytes=16 * MIB),
    # v5e: 197 TFLOP/s, 16 GiB at 819 GB/s, 400 GB/s bidirectional ICI over 4 ports (2D torus),
    # 8 chips and 2 x 100 Gbps NICs per host. (Binary gigabytes: libtpu offers a program 15.75 GiB,
    # more than 16e9 bytes; see XLA_USABLE_HBM.)
    "v5e": Chip("v5e", "tpu", 197e12, 16 * GIB, 819 * GB, 400 * GB, 4, 2 * 100e9 / 8 / 8, 8, 1, "chips",
                "v5e", 2, "default", 16, max_slice_chips=256, mxu_width=128,
                kernel_vmem_bytes=16 * MIB),
    # v5p: 459 TFLOP/s, 95 GiB at 2765 GB/s, 1200 GB/s bidirectional ICI (3D torus), DCN 50 Gbps
    # per chip, 4 chips per host.
    "v5p": Chip("v5p", "tpu", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, 6, 50e9 / 8, 4, 2, "cores",
                "v5p", 3, "megacore", 4, max_slice_chips=6144, mxu_width=128,
                kernel_vmem_bytes=16 * MIB),
    # v6e (Trillium): 918 TFLOP/s, 32 GiB at 1638 GB/s, 800 GB/s bidirectional ICI over 4 ports
    # (2D torus), 8 chips per host; DCN assumed as v5e's per-chip share scaled to 4 x 100 Gbps.
    # (Binary gigabytes: libtpu offers a program 31.24 GiB.)
    "v6e": Chip("v6e", "tpu", 918e12, 32 * GIB, 1638 * GB, 800 * GB, 4, 4 * 100e9 / 8 / 8, 8, 1, "chips",
                "v6e", 2, "default", 16, max_slice_chips=256, mxu_width=256,
                kernel_vmem_bytes=32 * MIB),
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; 8 per host,
    # one 400 Gbps InfiniBand NIC per GPU.
    "h100": Chip("h100", "gpu", 989e12, 80 * GB, 3350 * GB, 900 * GB, 18, 400e9 / 8, 8, 1, "chips",
                 None, 0),
    # H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s.
    "h200": Chip("h200", "gpu", 989e12, 141 * GB, 4800 * GB, 900 * GB, 18, 400e9 / 8, 8, 1, "chips",
                 None, 0),
    # The host CPU, for tests and small runs: nominal figures only.
    "cpu": Chip("cpu", "cpu", 1e11, 16 * GIB, 20 * GB, 20 * GB, 1, 20 * GB, 1, 1, "chips", None, 0),
}

ALIASES = {"v5litepod": "v5e"}

# HBM that XLA lets one program use on one device, as libtpu 0.0.52 states it when a program
# does not fit ("... exceeds available HBM (31.24G)", G meaning GiB): the chip's capacity less
# what the runtime keeps. Measured on this host by compiling programs too large for each target.
# This is what a plan must fit in. (v4 and v5p are described in megacore mode, one device per
# chip, as they train.)
XLA_USABLE_HBM = {"v4": int(30.75 * GIB), "v5e": int(15.75 * GIB), "v5p": int(95.73 * GIB),
                  "v6e": int(31.24 * GIB)}

# Slice shapes that are not a power-of-two progression (Google Cloud's v5p table).
_SPECIAL_SHAPES = {("v5p", 6144): (16, 16, 24)}


class TopologyError(ValueError):
    """A topology name or size that does not exist; the message says what does."""


def _torus_shape(chip: Chip, chips: int) -> tuple[int, ...]:
    """Physical slice shape, as Google Cloud lays out slices of this many chips."""
    if (chip.name, chips) in _SPECIAL_SHAPES:
        return _SPECIAL_SHAPES[(chip.name, chips)]
    if chips < 1 or chips & (chips - 1):
        raise TopologyError(f"{chip.name} slices hold a power of two chips, not {chips}")
    if chip.torus_dims == 2:
        shape = [1, 1]
        while math.prod(shape) < chips:
            # Grow the shorter side (the second on ties): 1x2, 2x2, 2x4, 4x4, 4x8, ...
            i = 1 if shape[1] <= shape[0] else 0
            shape[i] *= 2
        return tuple(shape)
    if chips < 4:
        raise TopologyError(f"the smallest {chip.name} slice has 4 chips ({chip.name}-8)")
    shape = [2, 2, 1]
    while math.prod(shape) < chips:
        # Double the smallest side (the last on ties): 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
        smallest = min(shape)
        i = max(j for j, s in enumerate(shape) if s == smallest)
        shape[i] *= 2
    return tuple(shape)


@dataclass(frozen=True)
class Topology:
    name: str  # as the user wrote it
    chip: Chip
    chips: int  # in all slices together
    slices: int = 1
    shape: tuple[int, ...] = ()  # physical shape of one slice
    hosts: int = 1

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def chips_per_slice(self) -> int:
        return self.chips // self.slices

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes

    @property
    def usable_hbm_bytes(self) -> int:
        """What one program may use on one device (XLA_USABLE_HBM; the capacity elsewhere)."""
        return XLA_USABLE_HBM.get(self.chip.name, self.chip.hbm_bytes)

    @property
    def libtpu_name(self) -> str | None:
        if self.chip.libtpu_name is None:
            return None
        return f"{self.chip.libtpu_name}:{'x'.join(str(s) for s in self.shape)}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which physical axes of a slice close into rings (libtpu's `wrap`)."""
        unit = self.chip.wrap_unit
        if not unit or not self.shape:
            return (False, False, False)
        if self.chip.torus_dims == 3:
            cubes = all(side % unit == 0 for side in self.shape)
            return (cubes, cubes, cubes)
        return tuple(side == unit for side in self.shape) + (False,)

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) if self.shape else "-"
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return (f"{self.name}: {self.chips} {self.chip.name} chips ({shape}{slices}), "
                f"{size_bytes(self.chip.hbm_bytes)} HBM each")

    def to_json(self) -> dict:
        return {"name": self.name, "chip": self.chip.name, "platform": self.platform,
                "chips": self.chips, "slices": self.slices, "shape": list(self.shape),
                "hosts": self.hosts, "libtpu_name": self.libtpu_name, "wrap": list(self.wrap)}


_NAME = re.compile(r"^(?P<gen>[a-z0-9]+?)-(?P<count>\d+)(x(?P<hosts>\d+))?$")


def parse(name: str, slices: int = 1) -> Topology:
    """A topology from its name; `slices` joins several identical TPU slices over DCN."""
    if slices < 1:
        raise TopologyError(f"--slices must be at least 1, not {slices}")
    if name == "local":
        return Topology("local", CHIPS["cpu"], 0, 1, (), 1)
    match = _NAME.match(name)
    if not match:
        raise TopologyError(f"unknown topology '{name}'; expected a name like v5p-1024, v5e-256, "
                            "v6e-256, v4-128, cpu-8, h100-8 or local (mxc topologies lists them)")
    gen = ALIASES.get(match["gen"], match["gen"])
    count, hosts = int(match["count"]), int(match["hosts"] or 1)
    if gen not in CHIPS:
        raise TopologyError(f"unknown accelerator '{match['gen']}' in '{name}'; known: "
                            + ", ".join(sorted(set(CHIPS) | set(ALIASES))))
    chip = CHIPS[gen]
    if chip.platform == "cpu":
        if slices != 1 or match["hosts"]:
            raise TopologyError("cpu-N is one host: --slices and xK do not apply")
        return Topology(name, chip, count, 1, (count,), 1)
    if chip.platform == "gpu":
        if count != chip.chips_per_host:
            raise TopologyError(f"{gen} hosts have {chip.chips_per_host} GPUs: write {gen}-"
                                f"{chip.chips_per_host} (or {gen}-{chip.chips_per_host}xK for K hosts)")
        if slices != 1:
            raise TopologyError("--slices applies to TPU slices; several GPU hosts are h100-8xK")
        return Topology(name, chip, count * hosts, 1, (hosts, count), hosts)
    if match["hosts"]:
        raise TopologyError(f"'{name}': TPU slices are joined with --slices, not xK")
    if chip.name_counts == "cores":
        if count % chip.cores_per_chip:
            raise TopologyError(f"{gen}-N counts TensorCores ({chip.cores_per_chip} per chip): "
                                f"N must be even, not {count}")
        per_slice = count // chip.cores_per_chip
    else:
        per_slice = count
    per_slice, slices = _split_into_slices(chip, name, per_slice, slices)
    shape = _torus_shape(chip, per_slice)
    hosts = max(1, per_slice // chip.chips_per_host) * slices
    return Topology(name, chip, per_slice * slices, slices, shape, hosts)


def _split_into_slices(chip: Chip, name: str, chips: int, slices: int) -> tuple[int, int]:
    """Chips per slice and slices, for a name larger than one slice can be.

    A v5e or v6e pod holds 256 chips: v5e-512 is two v5e-256 slices joined over DCN, as Google
    Cloud builds it (multislice). Elsewhere, a name past the largest slice does not exist."""
    largest = chip.max_slice_chips
    if not largest or chips <= largest:
        return chips, slices
    unit = "TensorCores" if chip.name_counts == "cores" else "chips"
    largest_name = f"{chip.name}-{largest * (chip.cores_per_chip if unit == 'TensorCores' else 1)}"
    if chip.torus_dims == 2 and chips % largest == 0:
        return largest, slices * (chips // largest)
    raise TopologyError(f"'{name}' is larger than the largest {chip.name} slice ({largest_name}, "
                        f"{largest} chips); join slices with --slices, e.g. --topology {largest_name} "
                        f"--slices {max(2, -(-chips // largest))}")


def known_names() -> list[str]:
    """Representative names for `mxc topologies` (every power of two is accepted)."""
    return (["v4-8", "v4-128", "v4-1024", "v4-4096"] + ["v5e-1", "v5e-8", "v5e-16", "v5e-64", "v5e-256"]
            + ["v5p-8", "v5p-128", "v5p-512", "v5p-1024", "v5p-12288"]
            + ["v6e-1", "v6e-8", "v6e-64", "v6e-256"] + ["h100-8", "h100-8x4", "h200-8", "cpu-8", "local"])


def host_has_accelerator() -> bool:
    """Whether TPU (/dev/accel*, /dev/vfio/N) or NVIDIA GPU device files exist on this host."""
    return any(glob.glob(pattern) for pattern in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*"))


def prepare_jax_platforms(topology_name: str | None = None) -> None:
    """Before jax is imported: on a host without accelerators, keep jax to its CPU backend.

    Otherwise jax probes libtpu, which prints `E0000 ... unexpected worker hostname` and other
    start-up lines on a host without TPUs. Describing a TPU slice for compiling loads libtpu on
    its own (devices() hides its noise there) and needs no TPU backend; the CUDA plugin describes
    GPUs only under JAX_PLATFORMS=cpu on such a host (docs/compile.md). A `cpu-N` topology gets
    its N virtual devices here, since XLA reads that count only when jax starts. What the user
    set (JAX_PLATFORMS, a device count in XLA_FLAGS) is left alone."""
    if "jax" in sys.modules:
        return
    topology = None
    if topology_name:
        with contextlib.suppress(TopologyError):
            topology = parse(topology_name)
    if not host_has_accelerator():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if topology is not None and topology.platform == "cpu" and topology.chips:
        request_host_devices(topology.chips)


def request_host_devices(count: int) -> None:
    """Ask XLA for `count` virtual CPU devices (read only when jax starts), unless the user's
    XLA_FLAGS already names a count."""
    from mxc.runtime.cpu_devices import request_cpu_devices

    request_cpu_devices(count)


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu writes start-up warnings straight to fd 2 on a host without TPUs; hide them.

    Not when LIBTPU_INIT_ARGS is set: libtpu ends the process itself (exit 1, one `ERROR:` line
    on fd 2) when that names a flag or value it refuses, and Python never gets control back to
    say why. Whoever sets libtpu's flags sees its start-up output instead."""
    if os.environ.get("MXC_DEBUG") or os.environ.get("LIBTPU_INIT_ARGS"):
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# device_kind spellings that do not contain the chip's table name.
_KIND_ALIASES = {"v5lite": "v5e", "v6lite": "v6e"}


def attached_topology(topology: Topology, found: list) -> Topology:
    """`local` made concrete: a topology of the `found` devices (their count and chip), so that
    planning and compiling for the host's devices use the same figures as a named topology."""
    if topology.name != "local":
        return topology
    if not found:
        raise TopologyError("local: this host has no devices jax can use")
    platform = found[0].platform
    kind = str(getattr(found[0], "device_kind", "")).lower().replace(" ", "")
    if platform == "cpu":
        chip = CHIPS["cpu"]
    else:
        names = [name for name in CHIPS if name in kind] + [chip for alias, chip in _KIND_ALIASES.items()
                                                             if alias in kind]
        if not names:
            raise TopologyError(f"local: no chip facts for the attached {found[0].device_kind!r} devices; "
                                f"name a topology (mxc topologies lists them)")
        chip = CHIPS[names[0]]
    return Topology("local", chip, len(found), 1, (len(found),), 1)


def devices(topology: Topology) -> list:
    """The devices to compile for: libtpu's description of a TPU slice (no TPU needed), the
    host's virtual CPU devices, or the attached devices."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    if topology.name == "local":
        return list(jax.devices())
    if topology.platform == "cpu":
        found = jax.devices("cpu")
        if len(found) < topology.chips:
            raise TopologyError(
                f"{topology.name} needs {topology.chips} CPU devices but this process has {len(found)}; "
                f"start it with XLA_FLAGS=--xla_force_host_platform_device_count={topology.chips}")
        return list(found[:topology.chips])
    if topology.platform == "tpu":
        from jax.experimental import topologies

        try:
            with _quiet_stderr():
                desc = topologies.get_topology_desc(
                    platform="tpu", topology_name=topology.libtpu_name,
                    chip_config_name=topology.chip.chip_config, wrap=topology.wrap,
                    **({"num_slices": topology.slices} if topology.slices > 1 else {}))
        except Exception as err:  # libtpu missing or refusing the shape
            raise TopologyError(f"cannot describe {topology.name} ({topology.libtpu_name}) with "
                                f"libtpu: {err}; install the TPU extra: pip install 'mxc[tpu]'") from None
        return list(desc.devices)
    raise TopologyError(f"compiling for {topology.chip.name} needs the CUDA PJRT plugin: "
                        "pip install 'mxc[gpu]'")


def device_mesh(topology: Topology, axis_names: tuple[str, ...], ici_sizes: tuple[int, ...],
                dcn_sizes: tuple[int, ...] | None = None, found: list | None = None):
    """A jax Mesh over the topology's devices, laid out along the physical torus.

    `ici_sizes` is the mesh inside one slice and `dcn_sizes` how each axis spans slices (its
    product is the number of slices). On TPUs jax's mesh_utils assigns mesh axes to torus
    dimensions, splitting a physical axis between two mesh axes where the shape needs it; other
    platforms get the devices in order."""
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    found = devices(topology) if found is None else found
    dcn_sizes = tuple(dcn_sizes or (1,) * len(axis_names))
    total = math.prod(ici_sizes) * math.prod(dcn_sizes)
    if total != len(found):
        raise TopologyError(f"a mesh of {total} devices does not cover {topology.name}'s {len(found)}")
    if topology.platform == "tpu" and topology.slices > 1:
        grid = mesh_utils.create_hybrid_device_mesh(list(ici_sizes), list(dcn_sizes), found,
                                                    allow_split_physical_axes=True)
    elif topology.platform == "tpu":
        grid = mesh_utils.create_device_mesh(list(ici_sizes), found, allow_split_physical_axes=True)
    else:
        shape = tuple(i * d for i, d in zip(ici_sizes, dcn_sizes))
        grid = np.asarray(found, dtype=object).reshape(shape)
    # Mesh(...) rather than jax.make_mesh: Auto axis types, so sharding constraints propagate.
    return Mesh(grid, axis_names)
