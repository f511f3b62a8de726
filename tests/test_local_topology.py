"""`local` (listed by `mxc topologies`) plans for the devices this host has: their count from
jax, their chip's facts from the table."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mxc.compiler.topology import CHIPS, TopologyError, attached_topology, known_names, parse


def test_local_is_listed():
    assert "local" in known_names()


def test_local_takes_the_attached_devices_count_and_chip():
    tpus = [SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")] * 8
    topology = attached_topology(parse("local"), tpus)
    assert (topology.chips, topology.chip, topology.shape) == (8, CHIPS["v5e"], (8,))
    gpus = [SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")] * 2
    assert attached_topology(parse("local"), gpus).chip == CHIPS["h100"]
    cpus = [SimpleNamespace(platform="cpu", device_kind="cpu")] * 3
    assert attached_topology(parse("local"), cpus).chips == 3
    assert attached_topology(parse("cpu-8"), cpus) == parse("cpu-8")  # named topologies stay as named


def test_local_refuses_devices_it_has_no_facts_for():
    with pytest.raises(TopologyError, match="no chip facts for the attached 'Mystery 9'"):
        attached_topology(parse("local"), [SimpleNamespace(platform="gpu", device_kind="Mystery 9")])


def test_mxc_plan_local_plans_for_the_host_devices():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "MXC_DEBUG")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    done = subprocess.run([str(Path(sys.executable).with_name("mxc")), "plan", "llama3-tiny", "-t", "local",
                           "--no-verify", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = json.loads(done.stdout)
    assert (chosen["topology"], chosen["chips"], chosen["chip"]) == ("local", 4, "cpu")
    assert math.prod(chosen["mesh"].values()) == 4
