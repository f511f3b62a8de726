"""The options XLA compiles mxc's functions with, beyond its defaults.

The manifest records them (`compiler_options`), so that a runtime which recompiles the
functions from their StableHLO exports builds the same programs.
"""

from __future__ import annotations

from mxc.spec.ir import ModelSpec, MoE

# The embedding lookup's gather runs on the TensorCores instead of being offloaded to the
# SparseCores: compiling the offload (libtpu's SparseCore compiler) costs a visible share of the
# compile's CPU time and memory, while a dense model's gather is a small copy against a step
# (measured in docs/compile.md, "What the compile time went into"). Only for dense models: an
# MoE layer's token dispatch may be a gather as well, large enough for the offload to pay.
_DENSE_TPU = {"xla_tpu_offload_gather_to_sparsecore": False}


def compiler_options(spec: ModelSpec, platform: str) -> dict[str, bool]:
    """The options for every function of `spec` compiled for `platform` ("tpu", "gpu", "cpu")."""
    dense = not any(isinstance(block.mlp, MoE) for block in spec.blocks.values())
    return dict(_DENSE_TPU) if platform == "tpu" and dense else {}


# Every file name in HLO locations (the traced frames: mxc's sources, jax's, the venv's) loses its
# folders, so an artifact does not carry the build host's paths (user name, home folder, venv
# layout), and the same model compiled from two checkouts gives the same bytes.
_FOLDERS = r"^.*[/\\]"


def portable_source_paths():
    """A context in which lowering writes source file names without their folders."""
    from jax._src import config

    return config.hlo_source_file_canonicalization_regex(_FOLDERS)
