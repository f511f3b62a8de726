"""The options XLA compiles mxc's functions with, beyond its defaults.

The manifest records them (`compiler_options`), so that a runtime which recompiles the
functions from their StableHLO exports builds the same programs.
"""

from __future__ import annotations

import os

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


# XLA:CPU runs every virtual device's program on one pool of max(cores, devices) threads (NPROC, when
# set, stands for the cores), and a collective holds its thread until every device has joined it.
# Collectives that do not depend on each other may run at once, so one device can hold several
# threads; with one thread a device, the last device found none left to join the collective the
# others waited in, and XLA aborted (docs/multimodal.md). Idle threads only cost their stacks.
CPU_THREADS_PER_DEVICE = 4


def request_cpu_threads(devices: int, environ=os.environ) -> None:
    """Give XLA:CPU's thread pool room for `devices` virtual devices' collectives at once; read when
    jax makes its CPU client, so it is set before that. A value the user set is left alone."""
    if devices > 1:
        environ.setdefault("NPROC", str(max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * devices)))


# Every file name in HLO locations (the traced frames: mxc's sources, jax's, the venv's) loses its
# folders, so an artifact does not carry the build host's paths (user name, home folder, venv
# layout), and the same model compiled from two checkouts gives the same bytes.
_FOLDERS = r"^.*[/\\]"


def portable_source_paths():
    """A context in which lowering writes source file names without their folders."""
    from jax._src import config

    return config.hlo_source_file_canonicalization_regex(_FOLDERS)
