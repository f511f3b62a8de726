"""Training runs on jemalloc that keeps its freed pages: a step's large buffers reuse the previous
step's pages instead of being faulted in (and zeroed by the kernel) again (mxc.runtime.allocator)."""

import json
import os
import subprocess
import sys

import pytest

from mxc.runtime import allocator
from runtime_support import child

needs_jemalloc = pytest.mark.skipif(allocator.find_jemalloc() is None, reason="jemalloc is not installed")


def _environment(**extra):
    inherited = ("LD_PRELOAD", "MALLOC_CONF", allocator.ENV_CHOICE, allocator.ENV_DONE, "XLA_FLAGS")
    return {k: v for k, v in os.environ.items() if k not in inherited} | {"JAX_PLATFORMS": "cpu", **extra}


def _faults(**env) -> dict:
    done = subprocess.run(child("allocator_faults"), capture_output=True, text=True, timeout=120,
                          env=_environment(**env))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_jemalloc
def test_a_training_process_reuses_its_pages_instead_of_faulting_them_in_every_step():
    kept = _faults()
    system = _faults(MXC_ALLOCATOR="system")
    assert kept["allocator"] == "jemalloc" and "dirty_decay_ms:-1" in kept["conf"]
    assert system["allocator"] == "system"
    # 64 MB are 16,384 pages: glibc maps them afresh on every call.
    assert system["faults"] > 10_000
    assert kept["faults"] < system["faults"] / 20


@needs_jemalloc
def test_only_the_run_command_restarts_on_jemalloc():
    # jemalloc prints its statistics at exit when MALLOC_CONF asks: seen only on jemalloc.
    def on_jemalloc(command: str) -> bool:
        done = subprocess.run([sys.executable, "-m", "mxc.runtime", command, "--help"], capture_output=True,
                              text=True, timeout=60, env=_environment(MALLOC_CONF="stats_print:true"))
        assert done.returncode == 0, done.stderr[-2000:]
        return "jemalloc statistics" in done.stderr

    assert on_jemalloc("run")
    assert not on_jemalloc("tokenize")


def test_the_training_configuration_never_purges_and_keeps_the_users_settings():
    assert allocator.training_malloc_conf(2) == "narenas:1,dirty_decay_ms:-1,muzzy_decay_ms:-1,thp:always"
    env = allocator.reexec_environment({"MALLOC_CONF": "narenas:4"}, "libjemalloc.so.2",
                                       allocator.training_malloc_conf())
    assert env["MALLOC_CONF"] == "narenas:4" and env["LD_PRELOAD"] == "libjemalloc.so.2"
