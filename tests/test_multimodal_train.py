"""Training with images: the image sidecar of a token file, packing that keeps an image with its
placeholders, the train and eval steps' image slots, `--freeze vision`, and (slow) a tiny Gemma 3
with a SigLIP tower compiled for cpu-8 that trains on synthetic image-text pairs and resumes
bitwise. The 27B-scale compiles with images: tests/test_multimodal_plan.py."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from image_train_steps import (assert_freezing_the_tower_leaves_it_alone, compile_for_cpu8, masked_nll,
                               one_train_step, train_step_batch_shapes, trains_and_resumes_bitwise)
from mxc.runtime.data import DataError, ImagePackedSequences, image_rows
from mxc.runtime.image_file import open_images, sidecar_path, write_image_tokens
from mxc.runtime.token_file import TokenFileError, open_tokens, write_tokens
from mxc.spec import load_text

# Gemma 3's text blocks and SigLIP's, shrunk: 2 text layers (one windowed), a 28-pixel image in
# 7-pixel patches, 2 encoder layers, 4 soft tokens; placeholder 7 between begin 5 and end 6.
TINY = """\
model gemma3-mm-tiny {
  vocab = 64
  d_model = 32
  max_seq = 64
  embedding = embedding(tied = true, scale = sqrt_d_model)
  final_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  param_dtype = float32
  compute_dtype = float32
  block local {
    attention = gqa(heads = 2, kv_heads = 1, head_dim = 16, window = 8, query_pre_attn_scalar = 16,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true), rope = rope(theta = 10000))
    mlp = glu(hidden = 64, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  block global {
    attention = gqa(heads = 2, kv_heads = 1, head_dim = 16, query_pre_attn_scalar = 16,
                    qk_norm = rmsnorm(eps = 1e-6, zero_centered = true), rope = rope(theta = 1000000))
    mlp = glu(hidden = 64, act = gelu_tanh)
    norm = rmsnorm(eps = 1e-6, zero_centered = true)
    post_norm = rmsnorm(eps = 1e-6, zero_centered = true)
  }
  layers = local, global
  vision = vision(image = 28, d_model = 32, patches = patches(size = 7, stride = 7),
                  positions = learned(),
                  block = encoder(attention = mha(heads = 2, head_dim = 16, rope = none, qkv_bias = true,
                                                  out_bias = true),
                                  mlp = mlp(hidden = 64, act = gelu_tanh, bias = true),
                                  norm = layernorm(eps = 1e-6)),
                  layers = 2, final_norm = layernorm(eps = 1e-6),
                  projector = avg_pool(tokens = 4, norm = rmsnorm(eps = 1e-6, zero_centered = true)),
                  entry = placeholder(token = 7, begin = 5, end = 6, bidirectional = true))
}
"""
PLACEHOLDER, BEGIN, END, EOD, PER_IMAGE, VOCAB = 7, 5, 6, 0, 4, 64


@pytest.fixture(scope="module")
def spec():
    return load_text(TINY, "tiny.mspec")["gemma3-mm-tiny"]


def _examples(count: int, seed: int, max_images: int = 2):
    """Synthetic pairs: text, images, text; image k of the stream is filled with the value k,
    so a slot's pixels say which image it holds."""
    rng = np.random.default_rng(seed)
    examples, image = [], 0
    for _ in range(count):
        parts = [rng.integers(10, VOCAB, rng.integers(1, 9))]
        for _ in range(rng.integers(0, max_images + 1)):
            parts += [np.full((3, 28, 28), float(image), np.float32), rng.integers(10, VOCAB, rng.integers(1, 5))]
            image += 1
        examples.append(parts)
    return examples


def _write(path, examples):
    return write_image_tokens(path, examples, vocab_size=VOCAB, eod_id=EOD, placeholder=PLACEHOLDER,
                              tokens_per_image=PER_IMAGE, begin=BEGIN, end=END)


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of placeholders in a row."""
    runs, start = [], None
    for i, token in enumerate(list(row) + [-1]):
        if token == PLACEHOLDER and start is None:
            start = i
        elif token != PLACEHOLDER and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_rows_keep_each_image_whole_with_its_placeholders(tmp_path):
    tokens, images = _write(tmp_path / "pairs.bin", _examples(40, seed=0))
    data = open_tokens(tmp_path / "pairs.bin")
    sidecar = open_images(data)
    assert len(sidecar) == images > 20 and len(data) == tokens
    seq, slots = 16, 2
    packed = ImagePackedSequences(data, sidecar, seq, slots)
    rows = packed.rows(np.arange(packed.count))
    seen = []
    for r in range(packed.count):
        runs = _runs(rows["inputs"][r])
        assert all(length == PER_IMAGE for _, length in runs), (r, rows["inputs"][r])  # never split
        assert len(runs) == rows["image_mask"][r].sum() <= slots
        # slot k holds the k-th image of the row, which is image (its pixel value) of the stream
        held = [int(rows["pixel_values"][r, k, 0, 0, 0]) for k in range(len(runs))]
        seen += held
        assert np.all(rows["pixel_values"][r, len(runs):] == 0)
        length = packed.lengths[r]
        assert not rows["mask"][r, length:].any() and np.all(rows["segment_ids"][r, length:] == 0)
        # a placeholder is never a target the loss counts: nothing can predict a soft token
        assert not np.any(rows["mask"][r] & (rows["targets"][r] == PLACEHOLDER))
    assert seen == list(range(images))  # every image once, in order
    assert (packed.lengths < seq).any()  # some rows were cut before an image and padded
    # consecutive rows overlap by one token, as text windows do: every token a target once
    assert np.array_equal(packed.starts[1:], packed.starts[:-1] + packed.lengths[:-1])


def test_data_an_image_cannot_fit_is_refused():
    offsets = np.array([3], np.int64)
    with pytest.raises(DataError, match="do not fit rows of 4"):
        image_rows(20, offsets, 6, 4, slots=1)
    with pytest.raises(DataError, match="0 image slots"):
        image_rows(20, offsets, 2, 8, slots=0)


def test_a_sidecar_beside_other_tokens_is_refused(tmp_path):
    _write(tmp_path / "a.bin", _examples(5, seed=1))
    write_tokens(tmp_path / "b.bin", [np.arange(10, 40)], vocab_size=VOCAB, eod_id=EOD, tokenizer="t")
    sidecar_path(tmp_path / "a.bin").rename(sidecar_path(tmp_path / "b.bin"))
    with pytest.raises(TokenFileError, match="other tokens"):
        open_images(open_tokens(tmp_path / "b.bin"))


def _reference_loss(spec, params, rows) -> float:
    """The packed batch's loss recomputed document by document through the forward pass with
    its flat list of images (compiler/lower/vision.with_images, the path checked against
    transformers in test_gemma3_vision.py), cross-entropy in numpy."""
    from mxc.compiler.lower.model import forward

    total, count = 0.0, 0
    for r in range(len(rows["inputs"])):
        images = iter(rows["pixel_values"][r][rows["image_mask"][r]])
        for segment in np.unique(rows["segment_ids"][r]):
            if segment == 0:  # padding
                continue
            where = np.flatnonzero(rows["segment_ids"][r] == segment)
            tokens = rows["inputs"][r, where]
            count_images = len(_runs(tokens))
            pixels = np.stack([next(images) for _ in range(count_images)]) if count_images else None
            logits, _ = forward(spec, params, jnp.asarray(tokens[None]),
                                pixel_values=None if pixels is None else jnp.asarray(pixels))
            nll, counted = masked_nll(logits[0], rows["targets"][r, where], rows["mask"][r, where])
            total, count = total + nll, count + counted
    return total / count


@pytest.mark.slow  # jit of the tiny train step: 1-2 min on this loaded 2-core host
def test_the_steps_loss_equals_the_forward_pass_document_by_document(tmp_path, spec):
    _write(tmp_path / "pairs.bin", _examples(12, seed=2))
    data = open_tokens(tmp_path / "pairs.bin")
    packed = ImagePackedSequences(data, open_images(data), 24, 2)
    rows = packed.rows(np.arange(4))
    assert rows["image_mask"].sum() >= 3 and len(np.unique(rows["segment_ids"][0])) > 1
    state, _, metrics = one_train_step(spec, rows, remat="none")
    assert float(metrics["loss"]) == pytest.approx(_reference_loss(spec, state.params, rows), abs=1e-5)


@pytest.mark.slow  # jit of the tiny train step: 1-2 min on this loaded 2-core host
def test_freezing_the_tower_leaves_it_and_its_optimizer_state_alone(tmp_path, spec):
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import make_train_step

    _write(tmp_path / "pairs.bin", _examples(8, seed=3))
    data = open_tokens(tmp_path / "pairs.bin")
    rows = ImagePackedSequences(data, open_images(data), 24, 2).rows(np.arange(4))
    assert_freezing_the_tower_leaves_it_alone(spec, rows, remat="none")
    with pytest.raises(ValueError, match="cannot freeze towers"):
        make_train_step(spec, OptimizerConfig(freeze=("towers",)))


# ------------------------------------------------------------------ cpu-8 and v5p-256

@pytest.mark.slow  # a cpu-8 compile and three runs: about 3 min under load
def test_a_tiny_multimodal_gemma3_trains_on_cpu8_and_resumes_bitwise(tmp_path):
    (tmp_path / "tiny.mspec").write_text(TINY)
    manifest = compile_for_cpu8(f"{tmp_path / 'tiny.mspec'}:gemma3-mm-tiny", tmp_path / "artifact",
                                "--seq", "16", "--batch", "8")
    shapes = train_step_batch_shapes(manifest)
    assert shapes[("pixel_values",)] == [8, 1, 3, 28, 28] and shapes[("image_mask",)] == [8, 1]

    # Captions a model can only get right by looking: the image's brightness names the words.
    rng = np.random.default_rng(4)
    examples = []
    for _ in range(200):
        label = int(rng.integers(0, 4))
        image = (rng.standard_normal((3, 28, 28)) * 0.1 + (label - 1.5)).astype(np.float32)
        examples.append([np.asarray([1, 2]), image, np.asarray([20 + label, 30 + label, 40 + label])])
    _write(tmp_path / "pairs.bin", examples)
    losses = trains_and_resumes_bitwise(tmp_path / "artifact", tmp_path / "pairs.bin", tmp_path)
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
