"""The options XLA compiles mxc's functions with, beyond its defaults.

The manifest records them (`compiler_options`), so that a runtime which recompiles the
functions from their StableHLO exports builds the same programs.
"""

from __future__ import annotations

from typing import Mapping

from mxc.spec.ir import ModelSpec, MoE

# The embedding lookup's gather runs on the TensorCores instead of being offloaded to the
# SparseCores: compiling the offload (libtpu's SparseCore compiler) costs a visible share of the
# compile's CPU time and memory, while a dense model's gather is a small copy against a step
# (measured in docs/compile.md, "What the compile time went into"). Only for dense models: an
# MoE layer's token dispatch may be a gather as well, large enough for the offload to pay.
_DENSE_TPU = {"xla_tpu_offload_gather_to_sparsecore": False}
# Without a tensor axis, no collective-matmul loops: past a size threshold XLA's TPU partitioner
# splits an FSDP weight's matmul into a loop over its pieces (a "windowed einsum"), each of whose
# steps adds into the whole output, so a layer reads and writes its largest outputs once per
# piece. Llama 3.1 8B on v6e-32, fsdp 32, mxc's automatic plan: 5.9 s a step estimated from the
# program with the loops (XLA's own estimated cycles for the accumulating kernel agree), 2.7 s
# without (docs/plans.md, "Collective matmul"). MaxText's recipes for such settings turn the loops
# off with the same option (its DISABLE_COLLECTIVE_MATMUL). With a tensor axis the loops overlap
# the activations' gathers with the matmuls, and XLA keeps its default.
_NO_TENSOR_TPU = {"xla_jf_spmd_threshold_for_windowed_einsum_mib": 1_000_000}


def compiler_options(spec: ModelSpec, platform: str, mesh_shape: Mapping[str, int] | None = None
                     ) -> dict[str, bool | int]:
    """The options for every function of `spec` compiled for `platform` ("tpu", "gpu", "cpu")
    over a mesh of `mesh_shape` (axis name -> size; None: options that do not depend on it)."""
    options: dict[str, bool | int] = {}
    if platform != "tpu":
        return options
    if not any(isinstance(block.mlp, MoE) for block in spec.blocks.values()):
        options.update(_DENSE_TPU)
    if mesh_shape is not None and not collective_matmul_loops(platform, mesh_shape):
        options.update(_NO_TENSOR_TPU)
    return options


def collective_matmul_loops(platform: str, mesh_shape: Mapping[str, int]) -> bool:
    """Whether XLA's collective-matmul loops stay on in programs compiled for `platform` over a
    mesh of `mesh_shape`: on TPUs where the mesh has a tensor axis (elsewhere mxc turns them off,
    and XLA's GPU and CPU compilers do not make them by default)."""
    return platform == "tpu" and mesh_shape.get("tensor", 1) > 1


# Every file name in HLO locations (the traced frames: mxc's sources, jax's, the venv's) loses its
# folders, so an artifact does not carry the build host's paths (user name, home folder, venv
# layout), and the same model compiled from two checkouts gives the same bytes.
_FOLDERS = r"^.*[/\\]"


def portable_source_paths():
    """A context in which lowering writes source file names without their folders."""
    from jax._src import config

    return config.hlo_source_file_canonicalization_regex(_FOLDERS)
