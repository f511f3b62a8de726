"""`mxc eval accuracy`: teacher-forced top-1/top-5 against a full-precision reference, on a tiny
Llama in a model directory with the byte-level tokenizer and the shipped public-domain text."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from mxc.compiler.cli import main
from mxc.compiler.commands.generate import spec_servable
from mxc.compiler.hf.spec_text import spec_text
from mxc.compiler.lower.params import init_params
from mxc.runtime.accuracy import Reference, teacher_forced_predictions
from mxc.runtime.params_io import save_params
from mxc.runtime.tokenize import byte_tokenizer
from mxc.spec.load import load_model

TEXT = Path(__file__).parents[1] / "data" / "text" / "pride_and_prejudice_ch1-6.txt"
PREFILL, DECODE = 24, 40  # scores 41 positions; small, so the test stays fast
SIZES = ["--prefill", str(PREFILL), "--decode", str(DECODE), "--speed-prompt", "8", "--speed-steps", "4"]
# Sharper than the training initialisation, so the argmax has a clear margin over the runner-up.
INIT_STD = 0.3


def _model_dir(path: Path, params) -> Path:
    spec = load_model("llama3-tiny")
    path.mkdir()
    (path / "model.mspec").write_text(spec_text(spec))
    save_params(path / "params", params)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny model directory, and a copy whose weights carry 20% noise."""
    base = tmp_path_factory.mktemp("eval-accuracy")
    spec = load_model("llama3-tiny")
    params = init_params(spec, jax.random.key(0), init_std=INIT_STD)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = jax.tree.unflatten(tree, [x * (1 + 0.2 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])
    return _model_dir(base / "model", params), _model_dir(base / "perturbed", noisy)


def _evaluate(capsys, *arguments: str) -> dict:
    assert main(["eval", "accuracy", *arguments, "--text", str(TEXT), "--tokenizer", "bytes", *SIZES, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_float32_scores_100_against_its_own_reference_and_reports_the_row(models, capsys, tmp_path):
    model, _ = models
    result = _evaluate(capsys, str(model), "--save-reference", str(tmp_path / "ref.npz"))
    assert (result["top1"], result["top5"]) == (100.0, 100.0)
    assert result["scored_positions"] == DECODE + 1 and result["precision"] == "fp32"
    assert result["tokens_per_second_per_user"] > 0 and result["ttft_ms"] > 0
    assert {"top1", "top5", "tokens_per_second_per_user", "ttft_ms", "precision"} <= set(result)
    reference = Reference.load(tmp_path / "ref.npz")
    assert reference.top5.shape == (PREFILL + DECODE + 1, 5)


def test_a_perturbed_model_scores_less_against_the_reference_directory(models, capsys):
    model, perturbed = models
    result = _evaluate(capsys, str(perturbed), "--reference", str(model))
    assert result["top1"] < 100.0 and result["top5"] >= result["top1"]


def test_a_stored_reference_gives_the_scores_of_its_directory(models, capsys, tmp_path):
    model, perturbed = models
    _evaluate(capsys, str(model), "--save-reference", str(tmp_path / "ref.npz"))
    stored = _evaluate(capsys, str(perturbed), "--reference", str(tmp_path / "ref.npz"))
    computed = _evaluate(capsys, str(perturbed), "--reference", str(model))
    assert (stored["top1"], stored["top5"]) == (computed["top1"], computed["top5"])


def test_teacher_forcing_feeds_the_text_not_the_predictions(models):
    from mxc.compiler.hf.model_dir import load_spec_and_params

    spec, params = load_spec_and_params(str(models[0]))
    servable = spec_servable(spec, 1, PREFILL, PREFILL + DECODE, "float32")
    fed = []

    def recording_decode(params, tokens, cache):
        fed.append(int(tokens[0]))
        return servable.decode(params, tokens, cache)

    tokens = np.asarray(byte_tokenizer().encode(TEXT.read_text()), np.int32)[:PREFILL + DECODE + 1]
    recording = servable.__class__(**{**servable.__dict__, "decode": recording_decode})
    predictions = teacher_forced_predictions(recording, params, tokens, PREFILL, DECODE)
    assert fed == tokens[PREFILL:PREFILL + DECODE].tolist()
    assert len(predictions) == DECODE + 1
    assert (predictions[:-1] != tokens[PREFILL + 1:PREFILL + DECODE + 1]).any()  # the model does not just echo the text


def test_bad_inputs_are_one_clear_error(models, capsys, tmp_path):
    model, _ = models
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert main(["eval", "accuracy", str(model), "--text", str(short), "--tokenizer", "bytes", *SIZES]) == 1
    assert "mxc: error: --text" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    assert main(["eval", "accuracy", str(model), "--text", str(TEXT), "--tokenizer", "bytes",
                 "--reference", str(bad), *SIZES]) == 1
    assert f"mxc: error: {bad}" in capsys.readouterr().err
    assert main(["eval", "accuracy", str(model), "--text", str(TEXT), *SIZES]) == 1
    assert "--tokenizer" in capsys.readouterr().err
