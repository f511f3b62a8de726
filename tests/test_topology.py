"""Topology names, chip facts and devices from libtpu's description on this CPU host."""

import os
import re

import pytest

from mxc.compiler.topology import CHIPS, TopologyError, devices, parse
from runtime_support import child


@pytest.mark.parametrize("name,chips,shape", [
    ("v5p-8", 4, (2, 2, 1)), ("v5p-128", 64, (4, 4, 4)), ("v5p-512", 256, (4, 8, 8)),
    ("v5p-1024", 512, (8, 8, 8)), ("v5p-12288", 6144, (16, 16, 24)),
    ("v4-128", 64, (4, 4, 4)), ("v5e-8", 8, (2, 4)), ("v5litepod-256", 256, (16, 16)),
    ("v6e-256", 256, (16, 16)), ("v6e-64", 64, (8, 8)),
])
def test_google_cloud_names(name, chips, shape):
    # Google Cloud's slice shapes (the same table MaxText and AxLearn keep).
    topo = parse(name)
    assert (topo.chips, topo.shape) == (chips, shape)


def test_several_slices_and_gpu_hosts():
    assert parse("v5e-256", slices=2).chips == 512
    assert parse("h100-8x4").chips == 32 and parse("h100-8x4").hosts == 4
    assert parse("cpu-8").chips == 8


@pytest.mark.parametrize("bad,words", [
    ("v5p-7", "even"), ("v5e-12", "power of two"), ("v9-8", "unknown accelerator"),
    ("h100-4", "8 GPUs"), ("nonsense", "unknown topology"),
])
def test_bad_names_say_what_exists(bad, words):
    with pytest.raises(TopologyError, match=words):
        parse(bad)


def test_chip_table_is_complete():
    for chip in CHIPS.values():
        assert chip.peak_bf16_flops > 0 and chip.hbm_bytes > 0 and chip.hbm_bandwidth > 0
    assert CHIPS["v5p"].hbm_bytes == 95 * 2**30


def test_tpu_devices_from_libtpu_without_a_tpu(capfd):
    found = devices(parse("v5p-1024"))
    assert len(found) == 512 and found[0].platform == "tpu"
    two = devices(parse("v5e-16", slices=2))
    assert sorted({getattr(d, "slice_index", 0) for d in two}) == [0, 1]
    # libtpu's start-up warnings stay away from the user.
    assert "TPU_WORKER" not in capfd.readouterr().err


@pytest.mark.parametrize("name,wrap", [
    ("v5p-8", (False, False, False)), ("v5p-64", (False, False, False)), ("v5p-128", (True, True, True)),
    ("v5p-1024", (True, True, True)), ("v4-128", (True, True, True)), ("v5e-64", (False, False, False)),
    ("v5e-128", (False, True, False)), ("v6e-256", (True, True, False)),
])
def test_wraparound_links(name, wrap):
    # Whole 4x4x4 cubes close every axis of a v4/v5p slice; a v5e/v6e axis closes at the pod edge.
    assert parse(name).wrap == wrap


def test_megacore_chips_are_one_device_each():
    assert len(devices(parse("v4-8"))) == 4 and len(devices(parse("v5p-8"))) == 4


def _weight_gather_collectives(topology, found) -> set[str]:
    """Collectives XLA emits for an FSDP layer: a batch-sharded input times a weight sharded on
    its input axis, which every device must gather. The mesh follows the torus (device_mesh)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mxc.compiler.topology import device_mesh

    n = len(found)
    mesh = device_mesh(topology, ("fsdp",), (n,), found=found)
    w = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    x = jax.ShapeDtypeStruct((n, 128, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None, None)))
    text = jax.jit(lambda w, x: x @ w).lower(w, x).compile().as_text()
    return set(re.findall(r" (all-gather|all-reduce)\(", text))


def test_torus_description_keeps_weight_gathers_native():
    # Described with its wraparound, the slice gets XLA's all-gather; the same slice described as
    # an open mesh makes XLA fall back to an all-reduce of zero-padded shards (twice the traffic).
    from jax.experimental import topologies

    topo = parse("v5p-128")
    assert _weight_gather_collectives(topo, devices(topo)) == {"all-gather"}
    open_mesh = topologies.get_topology_desc(platform="tpu", topology_name=topo.libtpu_name,
                                             chip_config_name=topo.chip.chip_config, wrap=(False, False, False)).devices
    assert _weight_gather_collectives(topo, list(open_mesh)) == {"all-reduce"}


@pytest.mark.parametrize("name,slices,per_slice,shape", [
    ("v5e-512", 2, 256, (16, 16)), ("v5e-2048", 8, 256, (16, 16)), ("v6e-1024", 4, 256, (16, 16)),
    ("v5e-256", 1, 256, (16, 16)),
])
def test_v5e_and_v6e_past_a_pod_are_several_slices(name, slices, per_slice, shape):
    # Google Cloud: a v5e or v6e pod (the largest slice) is 256 chips, 16x16; more is multislice.
    topo = parse(name)
    assert (topo.slices, topo.chips_per_slice, topo.shape) == (slices, per_slice, shape)
    assert topo.hosts == slices * 32 and parse(name, slices=2).slices == 2 * slices


@pytest.mark.parametrize("name", ["v5p-16384", "v4-16384"])
def test_past_the_largest_v4_or_v5p_slice_is_an_error(name):
    # v5p's largest slice is 6144 chips (16x16x24), v4's pod 4096 chips.
    with pytest.raises(TopologyError, match="larger than the largest .* --slices"):
        parse(name)


def test_v5e_past_a_pod_compiles_as_slices():
    two = devices(parse("v5e-512"))
    assert len(two) == 512 and sorted({d.slice_index for d in two}) == [0, 1]


def test_commands_on_a_cpu_host_print_no_libtpu_noise(tmp_path):
    # libtpu, probed by jax on a host without TPUs, writes `E0000 ... unexpected worker
    # hostname` lines; a command that needs no TPU keeps it away, one that compiles hides it.
    import subprocess
    import sys

    from mxc.compiler.topology import host_has_accelerator

    assert not host_has_accelerator(), "this test describes a host without accelerators"
    mxc = [sys.executable, "-m", "mxc.compiler.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "MXC_DEBUG")}
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1", MXC_CACHE_DIR=str(tmp_path / "cache"),
               XLA_FLAGS="--xla_backend_optimization_level=0")
    (tmp_path / "text.txt").write_text("hello world, hello tokens\n")
    subprocess.run(child("tiny_hf_llama", tmp_path / "hf"), check=True)
    steps = [
        (["import-hf", "hf", "-o", "imported"], 0),
        (["forward", "imported", "--tokens", "tokens.npy", "-o", "logits.npy"], 0),
        (["plan", "llama3-tiny", "--topology", "cpu-8", "--seq", "32", "--batch", "8"], 0),
        (["compile", "llama3-tiny", "--topology", "v5p-8", "--seq", "64", "--batch", "16", "--pin", "fsdp=4",
          "-o", "tpu-artifact"], 0),
        (["tokenize", "text.txt", "-o", "tokens.bin"], 0),
        # A TPU artifact on this CPU host: one clear error, without libtpu's lines around it.
        (["run", "tpu-artifact", "--data", "tokens.bin", "--steps", "1", "--ckpt-dir", "ckpt"], 1),
    ]
    for args, code in steps:
        done = subprocess.run(mxc + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == code, (args, done.stderr[-2000:])
        for noise in ("E0000", "unexpected worker hostname", "TPU_WORKER", "InitGoogle"):
            assert noise not in done.stderr, (args[0], done.stderr[-2000:])
