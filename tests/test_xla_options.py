"""The XLA options mxc compiles with: which models and platforms get them, and that each does what
its comment says in a real TPU compile (a child process, libtpu's v5p-8 topology)."""

from __future__ import annotations

import json

import pytest

from artifact_builds import child_report
from mxc.compiler.xla_options import compiler_options
from mxc.runtime.cpu_devices import CPU_THREADS_PER_DEVICE, request_cpu_threads
from mxc.spec.load import load_model


def test_dense_models_on_tpu_keep_the_embedding_gather_on_the_tensorcores():
    assert compiler_options(load_model("llama3.1-8b"), "tpu") == {"xla_tpu_offload_gather_to_sparsecore": False}
    assert compiler_options(load_model("llama3.1-8b"), "cpu") == {}
    assert compiler_options(load_model("llama3.1-8b"), "gpu") == {}


def test_moe_models_keep_xla_defaults():
    # Their token dispatch may be a gather large enough for the SparseCore offload to pay.
    assert compiler_options(load_model("mixtral-8x7b"), "tpu") == {}
    assert compiler_options(load_model("deepseek3-671b"), "tpu") == {}


def test_meshes_without_a_tensor_axis_turn_the_collective_matmul_loops_off():
    no_loops = {"xla_jf_spmd_threshold_for_windowed_einsum_mib": 1_000_000}
    fsdp = {"stage": 1, "data": 1, "fsdp": 32, "context": 1, "expert": 1, "tensor": 1}
    assert compiler_options(load_model("llama3.1-8b"), "tpu", fsdp) == {
        "xla_tpu_offload_gather_to_sparsecore": False, **no_loops}
    assert compiler_options(load_model("mixtral-8x7b"), "tpu", {"fsdp": 64, "expert": 4}) == no_loops
    assert compiler_options(load_model("llama3.1-8b"), "tpu", {**fsdp, "fsdp": 8, "tensor": 4}) == {
        "xla_tpu_offload_gather_to_sparsecore": False}
    assert compiler_options(load_model("llama3.1-8b"), "cpu", fsdp) == {}


def test_virtual_cpu_devices_get_a_thread_pool_for_their_collectives():
    # cpu-8 with fsdp aborts in XLA's rendezvous with the default pool (tests/test_multimodal_train.py)
    environ = {}
    request_cpu_threads(8, environ)
    assert int(environ["NPROC"]) >= CPU_THREADS_PER_DEVICE * 8 > 8
    environ = {"NPROC": "3"}  # the user's choice stays
    request_cpu_threads(8, environ)
    assert environ == {"NPROC": "3"}
    environ = {}  # one device runs no collectives
    request_cpu_threads(1, environ)
    assert environ == {}


def _tpu_child() -> dict:
    import jax
    import jax.numpy as jnp

    from mxc.compiler import topology
    from mxc.compiler.lower.embedding import lookup
    from mxc.compiler.lower.sharding import named_sharding, use_rules

    mesh = topology.device_mesh(topology.parse("v5p-8"), ("fsdp",), (4,))
    rules = {"batch": ("fsdp",), "embed": ("fsdp",)}
    with use_rules(mesh, rules):
        table = jax.ShapeDtypeStruct((32000, 1024), jnp.float32,
                                     sharding=named_sharding(("vocab", "embed"), mesh, rules))
        # 4 sequences of 4096 per chip, as in MaxText's recipe: libtpu offloads that lookup.
        tokens = jax.ShapeDtypeStruct((16, 4096), jnp.int32, sharding=named_sharding(("batch", "seq"), mesh, rules))
        lowered = jax.jit(lambda t, i: lookup(t, i, jnp.bfloat16)).lower(table, tokens)
    options = compiler_options(load_model("llama3.1-8b"), "tpu", dict(mesh.shape))
    # An FSDP weight's matmul on v5e-8, each device's activations [1, 2048, 2048] against a weight
    # of [2048, 8192] split over fsdp 8: XLA's default makes it a collective-matmul loop.
    mesh = topology.device_mesh(topology.parse("v5e-8"), ("fsdp",), (8,))
    with use_rules(mesh, rules):
        x = jax.ShapeDtypeStruct((8, 2048, 2048), jnp.bfloat16, sharding=named_sharding(("batch", "seq", None), mesh, rules))
        w = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=named_sharding(("embed", None), mesh, rules))
        matmul = jax.jit(lambda x, w: jnp.einsum("bse,em->bsm", x, w)).lower(x, w)
    # The executable's text cannot be printed here (jax cannot read back the SparseCore's async
    # instructions), so the offloaded kernels are counted by name in the serialised executable.
    report = {name: bytes(lowered.compile(compiler_options=opts).runtime_executable().serialize()).count(b"gather_offload")
              for name, opts in (("defaults", None), ("mxc", options))}
    for name, opts in (("loops_defaults", None), ("loops_mxc", options)):
        report[name] = matmul.compile(compiler_options=opts).as_text().count("windowed_dot_general")
    return report


@pytest.fixture(scope="module")
def tpu_report() -> dict:
    return child_report(__file__, timeout=600, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="")


def test_the_option_moves_the_gather_off_the_sparsecores(tpu_report):
    assert tpu_report["defaults"] >= 1  # libtpu offloads the lookup by default: the check can tell
    assert tpu_report["mxc"] == 0


def test_the_option_compiles_an_fsdp_matmul_without_the_collective_matmul_loop(tpu_report):
    assert tpu_report["loops_defaults"] >= 1  # XLA's default makes the loop: the check can tell
    assert tpu_report["loops_mxc"] == 0


if __name__ == "__main__":
    print(json.dumps(_tpu_child()))
