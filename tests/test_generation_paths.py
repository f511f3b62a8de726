"""`mxc generate MODEL` (prefill and decode jitted from the spec) and `mxc generate ARTIFACT` (the
precompiled executables) run one driver and one sampler: the same spec, parameters, prompts, seed
and sampling settings give the same tokens, for prompts shorter than the compiled prefill too."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from artifact_builds import run_mxc
from mxc.compiler.lower.params import init_params
from mxc.runtime.generate import PAD
from mxc.runtime.params_io import save_params
from mxc.spec.load import load_model

MODEL, PROMPT_LEN, CACHE_LEN, SERVE_BATCH, MAX_NEW = "llama3-tiny", 6, 24, 4, 10


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("generation_paths")
    artifact = base / "artifact"
    done = run_mxc(base, "compile", MODEL, "--topology", "cpu-1", "--seq", "16", "--batch", "2", "--serve",
                   "--serve-batch", str(SERVE_BATCH), "--prompt-len", str(PROMPT_LEN), "--cache-len",
                   str(CACHE_LEN), "-o", str(artifact))
    assert done.returncode == 0, done.stderr[-4000:]
    params = save_params(base / "params", init_params(load_model(MODEL), jax.random.key(3)))
    prompts = np.full((3, PROMPT_LEN), PAD, np.int32)
    for row, text in enumerate([b"The c", b"def", b"import"]):
        prompts[row, :len(text)] = list(text)
    np.save(base / "prompts.npy", prompts)
    return base, artifact, params


def _generate(base, model, params, output, *flags):
    done = run_mxc(base, "generate", str(model), "--params", str(params), "--prompt-tokens",
                   str(base / "prompts.npy"), "--max-new", str(MAX_NEW), "-o", str(output), *flags, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return np.load(output)


@pytest.mark.parametrize("sampling", [["--temperature", "1.3", "--top-k", "40", "--seed", "5"],
                                      ["--temperature", "0.9", "--top-p", "0.95", "--seed", "11"]])
def test_a_spec_and_its_artifact_sample_the_same_tokens(built, sampling):
    base, artifact, params = built
    from_artifact = _generate(base, artifact, params, base / "artifact.npy", *sampling)
    from_spec = _generate(base, MODEL, params, base / "spec.npy", "--dtype", "bfloat16", *sampling)
    assert from_artifact.shape == (3, PROMPT_LEN + MAX_NEW)
    np.testing.assert_array_equal(from_spec, from_artifact)
    assert len(set(from_artifact[:, PROMPT_LEN:].ravel().tolist())) > MAX_NEW  # it did sample
