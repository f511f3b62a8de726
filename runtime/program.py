"""A verified artifact bound to live devices: `load(path)` -> Program with callable functions.

Each function runs its executable on flat arrays; arguments are looked up in the caller's trees
by the manifest's leaf paths and placed with the recorded shardings, and results come back as
nested dicts and lists (a function returning several values returns a tuple). Donated arguments
(the train state of `train_step`, the cache of `decode`) are consumed by the call.

The native executable is deserialised with PJRT's own call, never through pickle. Where the
jax/jaxlib/libtpu versions on this host differ from the compiling host's, the portable StableHLO
export is compiled here instead, with a warning that says which versions and how long it took.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.runtime.artifact import ArtifactError, Function, Leaf, Manifest, Topology, path_name
from mxc.runtime.artifact_reader import check_devices, devices_by_topology_id, read_verified, version_differences
from mxc.runtime.tree_paths import build_tree, lookup

FlatRunner = Callable[[list], list]  # flat input arrays -> flat output arrays


class RecompiledWarning(UserWarning):
    """The artifact's executables were rebuilt from StableHLO because library versions differ."""


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, so that a recompile from StableHLO is paid once per host
    (a user's own setting wins)."""
    if jax.config.jax_compilation_cache_dir:
        return
    base = os.environ.get("MXC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mxc")
    jax.config.update("jax_compilation_cache_dir", os.path.join(base, "jax"))


def live_devices(platform: str) -> list:
    """The devices an artifact for `platform` would run on: every process's, in id order."""
    if platform == "cpu":
        return list(jax.devices("cpu"))
    return list(jax.devices())


def build_mesh(topology: Topology, devices: Sequence) -> Mesh:
    by_id = devices_by_topology_id(topology, devices)
    ordered = np.array([by_id[i] for i in topology.device_ids], dtype=object)
    return Mesh(ordered.reshape(tuple(topology.mesh.values())), tuple(topology.mesh))


def partition_spec(entries) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def leaf_sharding(mesh: Mesh, leaf: Leaf) -> NamedSharding:
    """The leaf's sharding, in the memory the executable takes it in (host memory for a plan's
    optimizer state kept there)."""
    sharding = NamedSharding(mesh, partition_spec(leaf.sharding))
    return sharding if leaf.memory_kind == "device" else sharding.with_memory_kind(leaf.memory_kind)


class BoundFunction:
    """One compiled function of the artifact, callable with pytrees."""

    def __init__(self, function: Function, mesh: Mesh, run_flat: FlatRunner):
        self.function = function
        self.name = function.name
        self.in_shardings = [leaf_sharding(mesh, leaf) for leaf in function.inputs]
        self.out_shardings = [leaf_sharding(mesh, leaf) for leaf in function.outputs]
        self._expected = [(jnp.dtype(leaf.dtype), tuple(leaf.shape)) for leaf in function.inputs]
        self._run_flat = run_flat
        self._per_layer_params = _per_layer_params_argument(function)

    def __repr__(self) -> str:
        return f"<mxc function {self.name}({', '.join(self.function.arguments)})>"

    def __call__(self, *args):
        if len(args) != len(self.function.arguments):
            raise TypeError(f"{self.name} takes {len(self.function.arguments)} arguments "
                            f"({', '.join(self.function.arguments)}), got {len(args)}")
        names = self.function.arguments
        if self._per_layer_params is not None:  # a checkpoint's stacked params, split for this call alone
            index = self._per_layer_params
            args = args[:index] + (self.params_as_taken(args[index]),) + args[index + 1:]
        flat = [_place(lookup(args, leaf.path, root=self.name), leaf, sharding, names, expected)
                for leaf, sharding, expected in zip(self.function.inputs, self.in_shardings, self._expected)]
        results = self._run_flat(flat)
        tree = build_tree([leaf.path for leaf in self.function.outputs], results)
        return tuple(tree) if isinstance(tree, list) else tree

    def params_as_taken(self, params):
        """A checkpoint's params laid out as this function takes them: where it was compiled for
        one array per layer (CPU serving, runtime/layer_layout.py), stacked params are split by one
        compiled program and placed with the executable's shardings, so no call places them again.
        Anything else comes back as it is. A caller running many steps converts once, here (the
        generation driver does: Servable.prepare); passed stacked to the call, they are split anew
        at every call, and no copy is kept."""
        from mxc.runtime.layer_layout import all_per_layer, per_layer_arrays

        index = self._per_layer_params
        if index is None or not isinstance(params, dict) or "segments" not in params or all_per_layer(params):
            return params
        leaves = [(leaf.path[1:], sharding) for leaf, sharding in zip(self.function.inputs, self.in_shardings)
                  if leaf.path[0] == index]
        return per_layer_arrays(params, build_tree([path for path, _ in leaves], [sharding for _, sharding in leaves]))


def _per_layer_params_argument(function: Function) -> int | None:
    """The index of `params` where the function takes them one array per layer (leaf paths
    [params, "segments", segment, layer, block, ...]); None otherwise."""
    if "params" not in function.arguments:
        return None
    index = function.arguments.index("params")
    for leaf in function.inputs:
        path = leaf.path
        if len(path) > 4 and path[0] == index and path[1] == "segments" and all(isinstance(p, int) for p in path[2:5]):
            return index
    return None


def _display(leaf: Leaf, names: list[str]) -> str:
    path = [names[leaf.path[0]], *leaf.path[1:]] if leaf.path and isinstance(leaf.path[0], int) else leaf.path
    return path_name(path)


def _place(value, leaf: Leaf, sharding: NamedSharding, names: list[str], expected: tuple):
    """The argument as a jax.Array with the compiled sharding (a no-op when it already is one);
    `expected`: the leaf's (dtype, shape), made once per function."""
    dtype, shape = expected
    if isinstance(value, jax.Array):
        if value.is_deleted():  # running on freed buffers crashes jaxlib (a segfault on multi-device CPU)
            raise ValueError(f"argument {_display(leaf, names)} was donated to a previous call (its buffers are "
                             "consumed); pass the state that call returned")
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(f"{_display(leaf, names)}: expected {dtype}{list(shape)}, found "
                             f"{value.dtype}{list(value.shape)}")
        placed = value.sharding
        return value if placed is sharding or placed == sharding else jax.device_put(value, sharding)
    array = np.asarray(value)
    if array.shape != shape:
        raise ValueError(f"{_display(leaf, names)}: expected shape {list(shape)}, found {list(array.shape)}")
    if array.dtype != dtype:
        if not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise ValueError(f"{_display(leaf, names)}: expected {dtype}, found {array.dtype}")
        array = array.astype(dtype)
    return jax.device_put(array, sharding)


def _renumbered_devices(devices: list):
    """Compile options that move an executable onto devices with other ids than it was compiled
    for, position by position: virtual CPU devices split over several processes are numbered
    per process (0-3 and 2048-2051 for two processes of 4), not 0-7 as in the compiling process."""
    from jaxlib.xla_client import CompileOptions, DeviceAssignment

    options = CompileOptions()
    options.device_assignment = DeviceAssignment.create(np.array([[d.id for d in devices]]))
    options.executable_build_options.num_replicas = 1
    options.executable_build_options.num_partitions = len(devices)
    options.executable_build_options.use_spmd_partitioning = True
    return options


# HLO element types by the numpy name the manifest uses.
HLO_TYPES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8",
             "u16": "uint16", "u32": "uint32", "u64": "uint64", "f16": "float16", "bf16": "bfloat16",
             "f32": "float32", "f64": "float64", "s4": "int4", "u4": "uint4", "f8e4m3fn": "float8_e4m3fn",
             "f8e5m2": "float8_e5m2"}  # the last four: quantized weights (mxc compile --quantize)
HLO_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def executable_parameters(executable) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, per-device shape) of each parameter of a loaded executable, from its entry layout."""
    header = executable.hlo_modules()[0].to_string().split("\n", 1)[0]
    parameters = header.split("entry_computation_layout={(", 1)[1].split(")->", 1)[0]
    return [(HLO_TYPES.get(kind, kind), tuple(int(d) for d in dims.split(",") if d))
            for kind, dims in HLO_SHAPE.findall(parameters)]


def check_parameters(function: Function, executable, mesh: Mesh) -> None:
    """The executable takes the manifest's inputs: running it on other buffers crashes jaxlib (a
    segfault on multi-device CPU) instead of raising."""
    found = executable_parameters(executable)
    if len(found) != len(function.inputs):
        raise ArtifactError(f"{function.executable} takes {len(found)} parameters, but the manifest lists "
                            f"{len(function.inputs)} inputs of {function.name}")
    for index, (leaf, (dtype, shape)) in enumerate(zip(function.inputs, found)):
        expected = leaf_sharding(mesh, leaf).shard_shape(tuple(leaf.shape))
        if dtype != leaf.dtype or shape != tuple(expected):
            raise ArtifactError(f"{function.executable} does not match the manifest: parameter {index} "
                                f"({_display(leaf, function.arguments)}) is {dtype}{list(shape)} per device, "
                                f"the manifest says {leaf.dtype}{list(expected)}")


def _native_runner(function: Function, data: bytes, mesh: Mesh, compiled_ids: list[int]) -> FlatRunner:
    from jaxlib.xla_client import DeviceList

    devices = list(mesh.devices.flat)
    options = None if [d.id for d in devices] == compiled_ids else _renumbered_devices(devices)
    executable = devices[0].client.deserialize_executable(data, DeviceList(tuple(devices)), options)
    check_parameters(function, executable, mesh)
    outputs = [(tuple(leaf.shape), leaf_sharding(mesh, leaf)) for leaf in function.outputs]

    def run(flat: list) -> list:
        shards = executable.execute_sharded(flat).disassemble_into_single_device_arrays()
        return [jax.make_array_from_single_device_arrays(shape, sharding, pieces)
                for (shape, sharding), pieces in zip(outputs, shards)]

    return run


def _recompiled_runner(function: Function, data: bytes, mesh: Mesh, options: dict) -> tuple[FlatRunner, dict]:
    """The function compiled from its StableHLO export, and the compiler options it was compiled
    with: the artifact's, or none where this compiler refuses them (said once, in a warning)."""
    exported = jax.export.deserialize(bytearray(data))
    in_shardings = tuple(leaf_sharding(mesh, leaf) for leaf in function.inputs)
    donated = tuple(i for i, leaf in enumerate(function.inputs) if leaf.donated)
    jitted = jax.jit(exported.call, in_shardings=in_shardings,
                     out_shardings=tuple(leaf_sharding(mesh, leaf) for leaf in function.outputs),
                     donate_argnums=donated, keep_unused=True)
    avals = [jax.ShapeDtypeStruct(tuple(leaf.shape), jnp.dtype(leaf.dtype), sharding=sharding)
             for leaf, sharding in zip(function.inputs, in_shardings)]
    lowered = jitted.lower(*avals)
    try:
        compiled = lowered.compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as err:
        # A newer compiler may have dropped an option; the program is the same without it.
        if not options or "compile option" not in str(err):
            raise
        warnings.warn(f"this compiler refuses the artifact's compiler options ({str(err).splitlines()[0]}); "
                      f"recompiled without them", RecompiledWarning, stacklevel=3)
        options = {}
        compiled = lowered.compile()
    return (lambda flat: list(compiled(*flat))), options


class Program:
    """The artifact's functions bound to this host's devices: `init(seed)`, `train_step(state,
    batch)`, `eval_step(params, batch)`, and with a serving build `prefill(params, tokens, lengths)` and
    `decode(params, tokens, cache)`."""

    def __init__(self, directory: Path, manifest: Manifest, mesh: Mesh, functions: dict[str, BoundFunction],
                 recompiled_from: list[str]):
        self.directory = directory
        self.manifest = manifest
        self.mesh = mesh
        self.functions = functions
        self.recompiled_from = recompiled_from  # the version differences that forced a recompile

    def __getattr__(self, name: str) -> BoundFunction:
        functions = self.__dict__.get("functions", {})
        if name in functions:
            return functions[name]
        if name in ("prefill", "decode"):
            raise AttributeError(f"{self.__dict__.get('directory')} has no {name}: compile it with --serve")
        raise AttributeError(name)

    def sharding(self, function: str, path: Sequence) -> NamedSharding:
        """The sharding of one input of a function, e.g. ("train_step", [1, "inputs"])."""
        bound = self.functions[function]
        for leaf, sharding in zip(bound.function.inputs, bound.in_shardings):
            if leaf.path == list(path):
                return sharding
        raise KeyError(f"{function} has no input {list(path)}")

    def __repr__(self) -> str:
        return (f"<mxc program {self.manifest.model} for {self.manifest.topology.name}: "
                f"{', '.join(self.functions)}>")


def load(path: str | Path, devices: Sequence | None = None, trusted_keys: Sequence | None = None) -> Program:
    """Verify the artifact at `path` (hashes, format, versions, devices), then bind it. With
    trusted public keys (`trusted_keys`, else $MXC_TRUSTED_KEYS) it must be signed by one of them.

    Raises ArtifactError, saying what was expected and what was found, before any executable is
    deserialised or run."""
    verified = read_verified(path, trusted_keys)
    manifest = verified.manifest
    topology = manifest.topology
    devices = list(devices) if devices is not None else live_devices(topology.platform)
    check_devices(topology, devices)
    mesh = build_mesh(topology, devices)
    differences = version_differences(manifest.versions, topology.platform)
    enable_compilation_cache()
    functions = {}
    options = manifest.compiler_options
    started = time.perf_counter()
    for name, function in manifest.functions.items():
        if differences:
            runner, options = _recompiled_runner(function, verified.contents[function.export], mesh, options)
        else:
            try:
                runner = _native_runner(function, verified.contents[function.executable], mesh,
                                        topology.device_ids)
            except ArtifactError:
                raise
            except Exception as err:  # PJRT's refusal of an intact file: a platform it cannot load
                raise ArtifactError(f"{function.executable} does not load on {topology.platform}: {err}") from None
        functions[name] = BoundFunction(function, mesh, runner)
    if differences:
        warnings.warn(f"{path}: library versions differ from the compiling host ({', '.join(differences)}); "
                      f"recompiled {len(functions)} functions from StableHLO in "
                      f"{time.perf_counter() - started:.1f} s", RecompiledWarning, stacklevel=2)
    return Program(Path(path), manifest, mesh, functions, differences)

