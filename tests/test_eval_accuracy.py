"""`mxc eval accuracy`: teacher-forced top-1/top-5 against a full-precision reference, on a tiny
Llama in a model directory with the byte-level tokenizer and the shipped public-domain text."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from mxc.compiler.cli import main
from mxc.compiler.commands.generate import spec_servable
from mxc.compiler.hf.model_dir import load_spec_and_params
from mxc.compiler.hf.spec_text import spec_text
from mxc.compiler.lower.params import param_shapes
from mxc.runtime.accuracy import Reference, score, teacher_forced_predictions
from mxc.runtime.params_io import save_params
from mxc.runtime.tokenize import byte_tokenizer
from mxc.spec.load import load_model

MXC = str(Path(sys.executable).with_name("mxc"))
TEXT = Path(__file__).parents[1] / "data" / "text" / "pride_and_prejudice_ch1-6.txt"
PREFILL, DECODE = 24, 40  # scores 41 positions; small, so the test stays fast
# The speed's prompt and steps match the accuracy's sizes: one servable, compiled once.
SIZES = ["--prefill", str(PREFILL), "--decode", str(DECODE), "--speed-prompt", str(PREFILL), "--speed-steps", str(DECODE)]
# Sharper than the training initialisation, so the argmax has a clear margin over the runner-up.
INIT_STD = 0.3


def _random_params(spec, seed: int) -> dict:
    rng = np.random.default_rng(seed)  # numpy: jax.random per leaf costs seconds of dispatch here
    return jax.tree.map(lambda s: (INIT_STD * rng.standard_normal(s.shape)).astype(s.dtype), param_shapes(spec))


def _model_dir(path: Path, params) -> Path:
    path.mkdir()
    # Float32 compute, as an imported float32 checkpoint has: an artifact of it computes as the reference does.
    (path / "model.mspec").write_text(spec_text(load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})))
    save_params(path / "params", params)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny model directory, and a copy of its parameters with 20% noise on every weight."""
    spec = load_model("llama3-tiny")
    params = _random_params(spec, 0)
    rng = np.random.default_rng(1)
    noisy = jax.tree.map(lambda x: x * (1 + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype), params)
    return _model_dir(tmp_path_factory.mktemp("eval-accuracy") / "model", params), noisy


@pytest.fixture(scope="module")
def float32_run(models, tmp_path_factory):
    """`mxc eval accuracy` of the float32 model against its own reference (computed, and saved)."""
    reference = tmp_path_factory.mktemp("reference") / "ref.npz"
    return _evaluate(str(models[0]), "--save-reference", str(reference)), reference


@pytest.fixture(scope="module")
def servable(models):
    spec, params = load_spec_and_params(str(models[0]))
    return spec_servable(spec, 1, PREFILL, PREFILL + DECODE, "float32"), params


def _evaluate(*arguments: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["eval", "accuracy", *arguments, "--text", str(TEXT), "--tokenizer", "bytes", *SIZES, "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def _text_tokens() -> np.ndarray:
    return np.asarray(byte_tokenizer().encode(TEXT.read_text()), np.int32)[:PREFILL + DECODE + 1]


def test_float32_scores_100_against_its_own_reference_and_reports_the_row(float32_run):
    result, saved = float32_run
    assert (result["top1"], result["top5"]) == (100.0, 100.0)
    assert result["scored_positions"] == DECODE + 1 and result["precision"] == "fp32"
    assert result["tokens_per_second_per_user"] > 0 and result["ttft_ms"] > 0
    assert {"top1", "top5", "tokens_per_second_per_user", "ttft_ms", "precision"} <= set(result)
    reference = Reference.load(saved)
    assert reference.top5.shape == (PREFILL + DECODE + 1, 5)
    assert (reference.tokens == _text_tokens()).all()


def test_a_perturbed_model_scores_less(models, float32_run, servable):
    serve, params = servable
    # Placed as the loaded parameters are, so the jitted functions run without compiling again.
    noisy = jax.tree.map(lambda placed, x: jax.device_put(x, placed.sharding), params, models[1])
    predictions = teacher_forced_predictions(serve, noisy, _text_tokens(), PREFILL, DECODE)
    scores = score(predictions, Reference.load(float32_run[1]), PREFILL)
    assert scores.top1 < 100.0 and scores.top5 >= scores.top1 and scores.positions == DECODE + 1


def test_teacher_forcing_feeds_the_text_not_the_predictions(servable):
    serve, params = servable
    fed = []

    def recording_decode(params, tokens, cache):
        fed.append(int(tokens[0]))
        return serve.decode(params, tokens, cache)

    tokens = _text_tokens()
    recording = serve.__class__(**{**serve.__dict__, "decode": recording_decode})
    predictions = teacher_forced_predictions(recording, params, tokens, PREFILL, DECODE)
    assert fed == tokens[PREFILL:PREFILL + DECODE].tolist()
    assert len(predictions) == DECODE + 1
    assert (predictions[:-1] != tokens[PREFILL + 1:PREFILL + DECODE + 1]).any()  # the model does not echo the text


@pytest.mark.slow
def test_a_stored_reference_gives_the_scores_of_its_directory(models, float32_run, tmp_path):
    perturbed = _model_dir(tmp_path / "perturbed", models[1])
    stored = _evaluate(str(perturbed), "--reference", str(float32_run[1]))
    computed = _evaluate(str(perturbed), "--reference", str(models[0]))
    assert (stored["top1"], stored["top5"]) == (computed["top1"], computed["top5"]) and stored["top1"] < 100.0


def test_bad_inputs_are_one_clear_error(models, capsys, tmp_path):
    model = str(models[0])
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert main(["eval", "accuracy", model, "--text", str(short), "--tokenizer", "bytes", *SIZES]) == 1
    assert "mxc: error: --text" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    assert main(["eval", "accuracy", model, "--text", str(TEXT), "--tokenizer", "bytes",
                 "--reference", str(bad), *SIZES]) == 1
    assert f"mxc: error: {bad}" in capsys.readouterr().err
    assert main(["eval", "accuracy", model, "--text", str(TEXT), *SIZES]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["eval", "accuracy", model, "--text", str(TEXT), "--tokenizer", "bytes", "--quantize", "int3", *SIZES]) == 1
    assert "mxc: error: --quantize: unknown quantization 'int3'" in capsys.readouterr().err


def test_a_quantized_model_directory_measures_accuracy_alone(models, float32_run):
    """--quantize int8 quantizes the directory's float weights as `mxc quantize` does; --only
    accuracy leaves the speed cells empty."""
    result = _evaluate(str(models[0]), "--reference", str(float32_run[1]), "--quantize", "int8", "--only", "accuracy")
    assert result["precision"] == "int8 (fp32 compute)"
    assert 80.0 <= result["top1"] < 100.0 and result["top5"] >= 95.0
    assert result["tokens_per_second_per_user"] is None and result["ttft_ms"] is None


@pytest.mark.slow
def test_speed_alone_needs_no_reference(models):
    result = _evaluate(str(models[0]), "--only", "speed")
    assert result["top1"] is None and result["top5"] is None and "segments" not in result
    assert result["tokens_per_second_per_user"] > 0 and result["ttft_ms"] > 0


@pytest.mark.slow
def test_an_int8_artifact_scores_below_100_but_high(models, float32_run, tmp_path):
    """Compiled for this host with --quantize int8 and given the float checkpoint (quantized at
    load), against the float32 model's stored reference."""
    model = models[0]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    env.pop("XLA_FLAGS", None)
    compiled = subprocess.run([MXC, "compile", str(model / "model.mspec"), "-t", "local", "--serve", "--serve-batch", "1",
                               "--prompt-len", str(PREFILL), "--cache-len", str(PREFILL + DECODE), "--quantize", "int8",
                               "--functions", "prefill,decode", "-o", str(tmp_path / "int8")],
                              env=env, capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    done = subprocess.run([MXC, "eval", "accuracy", str(tmp_path / "int8"), "--params", str(model / "params"),
                           "--reference", str(float32_run[1]), "--text", str(TEXT), "--tokenizer", "bytes", *SIZES,
                           "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["precision"] == "int8 (fp32 compute)"
    assert 80.0 <= result["top1"] < 100.0 and result["top5"] >= 95.0


def test_the_markdown_row_has_the_columns_of_the_header():
    from mxc.compiler.commands.eval_accuracy import TABLE_HEADER, table_row

    row = table_row({"model": "m", "device": "CPU (2 cores)", "precision": "int8 (fp32 compute)", "top1": 97.561,
                     "top5": 100.0, "tokens_per_second_per_user": 31.25, "ttft_ms": 338.4})
    assert row == "| m | CPU (2 cores) | int8 (fp32 compute) | 97.6 | 100.0 | 31.2 | 338 |"
    assert row.count("|") == TABLE_HEADER.splitlines()[0].count("|")
    unmeasured = table_row({"model": "m", "device": "d", "precision": "fp32", "top1": None, "top5": None,
                            "tokens_per_second_per_user": 31.25, "ttft_ms": 338.4})
    assert unmeasured == "| m | d | fp32 | – | – | 31.2 | 338 |"


def test_a_prefill_shorter_than_the_compiled_prompt_counts_its_padding_slots():
    """The prefill writes all of its prompt_len slots, so a 16-token prefill on a 21-token program
    leaves 7 of 28 slots: 8 decode steps would write past the cache (whose last slot XLA clamps to)."""
    from mxc.runtime.accuracy import AccuracyError, check_sizes
    from mxc.runtime.generate import Servable

    servable = Servable(prefill=None, decode=None, abstract_params=None, batch=1, prompt_len=21, cache_len=28,
                        vocab_size=300)
    check_sizes(servable, 40, 16, 7)
    with pytest.raises(AccuracyError, match="need a cache of 29 slots"):
        check_sizes(servable, 40, 16, 8)
