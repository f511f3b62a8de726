"""Dropless routing with expert parallelism (compiler/lower/expert_dispatch.py): on 8 virtual CPU
devices with expert axes of 2 and 4, outputs, loss and gradients equal the one-device dropless
path and the capacity path with room for every assignment (tests/children/dropless_ep.py). With
the experts unsplit, each batch shard's grouped matmul through megablox (Pallas' interpreter)
equals the one-device path too (tests/children/dropless_batch_shards.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from runtime_support import child, cpu_env


def _run(*families: str, script: str = "dropless_ep", done: str = "dropless ep ok") -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = cpu_env(8, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(child(script, *families), capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and done in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


def test_dropless_expert_parallel_matches_one_device():
    """DeepSeek V3's router: sigmoid scores, groups, correction bias, shared experts."""
    _run("deepseek3")


@pytest.mark.slow
def test_dropless_expert_parallel_matches_one_device_for_every_router():
    """Softmax top-k (Mixtral), expert biases (GPT-OSS), weights on the input (Llama 4)."""
    _run("mixtral", "gpt_oss", "llama4")


def test_dropless_batch_shards_run_megablox_and_match_one_device():
    """Unsplit experts on an fsdp mesh (the plans' dropless path without expert parallelism):
    megablox in a region manual over every axis; ragged_dot where a tensor axis remains."""
    _run("mixtral", script="dropless_batch_shards", done="dropless batch shards ok")
