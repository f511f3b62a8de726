"""Quantized artifacts end to end (slow: each compiles): `mxc compile --quantize`, `mxc quantize`
checkpoints and their sizes, `mxc generate ARTIFACT` from float and quantized checkpoints, and
XLA's memory analysis of a quantized llama3.1-8b on v5p-8."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from artifact_builds import run_mxc

TINY_SERVE = ["llama3-tiny", "-t", "local", "--serve", "--serve-batch", "1", "--prompt-len", "16",
              "--cache-len", "32", "--functions", "prefill,decode"]


def _ok(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_quantized_artifact_serves_float_and_quantized_checkpoints(tmp_path):
    from mxc.compiler.lower.params import init_params
    from mxc.runtime.params_io import save_params
    from mxc.spec.load import load_model

    save_params(tmp_path / "float", init_params(load_model("llama3-tiny"), jax.random.key(0)))
    artifact = tmp_path / "artifact"
    _ok(run_mxc(tmp_path, "compile", *TINY_SERVE, "--quantize", "int8+int8-kv", "-o", str(artifact)))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["spec"]["quantize"] == "int8+int8-kv"
    decode_inputs = {tuple(leaf["path"]): leaf["dtype"] for leaf in manifest["functions"]["decode"]["inputs"]}
    assert decode_inputs[(0, "segments", 0, 0, "attention", "q", "kernel")] == "int8"
    assert decode_inputs[(0, "segments", 0, 0, "attention", "q", "kernel_scale")] == "float32"
    assert decode_inputs[(2, "segments", 0, 0, "k")] == "int8"  # the int8 KV cache

    sizes = {}
    for config in ("int8", "int4"):
        done = _ok(run_mxc(tmp_path, "quantize", "llama3-tiny", "--params", str(tmp_path / "float"), "--config",
                           config, "-o", str(tmp_path / config), "--json"))
        sizes[config] = json.loads(done.stdout)
    assert 0.45 < sizes["int8"]["quantized_bytes"] / sizes["int8"]["bfloat16_bytes"] < 0.6
    assert 0.22 < sizes["int4"]["quantized_bytes"] / sizes["int4"]["bfloat16_bytes"] < 0.35
    for config in ("int8", "int4"):  # what is on disk shows the saving too
        assert sizes[config]["checkpoint_bytes"] < 1.3 * sizes[config]["quantized_bytes"]

    np.save(tmp_path / "prompt.npy", (np.arange(10, dtype=np.int32)[None] * 7) % 256)
    outputs = {}
    for name in ("float", "int8"):  # a float checkpoint is quantized as it loads
        out = tmp_path / f"tokens-{name}.npy"
        _ok(run_mxc(tmp_path, "generate", str(artifact), "--params", str(tmp_path / name), "--prompt-tokens",
                    str(tmp_path / "prompt.npy"), "--max-new", "8", "-o", str(out)))
        outputs[name] = np.load(out)
    assert outputs["float"].shape == (1, 18)
    np.testing.assert_array_equal(outputs["float"], outputs["int8"])

    refused = run_mxc(tmp_path, "generate", str(artifact), "--params", str(tmp_path / "int4"), "--prompt-tokens",
                      str(tmp_path / "prompt.npy"), "--max-new", "8", "-o", str(tmp_path / "x.npy"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr and "int4" in refused.stderr
    bad = run_mxc(tmp_path, "compile", *TINY_SERVE, "--quantize", "int9", "-o", str(tmp_path / "bad"))
    assert bad.returncode == 1 and bad.stderr.startswith("mxc: error: --quantize: unknown quantization 'int9'")


@pytest.mark.slow
def test_int8_llama_8b_on_v5p_8_holds_its_weights_in_half_of_bfloat16(tmp_path):
    """XLA's memory analysis of the decode step's arguments (the weights, and a cache kept small)
    against the weights' size in bfloat16 counted from the parameter shapes."""
    from mxc.compiler.lower.params import param_shapes
    from mxc.spec.load import load_model

    artifact = tmp_path / "8b"
    _ok(run_mxc(tmp_path, "compile", "llama3.1-8b", "--topology", "v5p-8", "--serve", "--serve-batch", "4",
                "--prompt-len", "64", "--cache-len", "128", "--quantize", "int8", "--functions", "decode",
                "-o", str(artifact)))
    manifest = json.loads((artifact / "manifest.json").read_text())
    devices = manifest["topology"]["devices"]
    parameters = sum(leaf.size for leaf in jax.tree.leaves(param_shapes(load_model("llama3.1-8b"))))
    bfloat16_per_device = parameters * 2 / devices
    arguments = manifest["functions"]["decode"]["memory"]["argument_bytes"]
    assert 0.45 < arguments / bfloat16_per_device < 0.56, arguments / bfloat16_per_device


@pytest.mark.slow
def test_fp8_quantization_aware_train_step_compiles_for_v5p(tmp_path):
    artifact = tmp_path / "qat"
    _ok(run_mxc(tmp_path, "compile", "llama3-tiny", "--topology", "v5p-8", "--seq", "64", "--batch", "16",
                "--quantize", "fp8", "--functions", "train_step", "-o", str(artifact)))
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["spec"]["quantize"] == "fp8" and manifest["topology"]["platform"] == "tpu"
    params = [leaf for leaf in manifest["functions"]["train_step"]["inputs"] if leaf["path"][:2] == [0, "params"]]
    assert params and all(leaf["dtype"] == "float32" for leaf in params)  # trained in float, fake-quantized
