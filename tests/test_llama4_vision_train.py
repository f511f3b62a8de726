"""Llama 4 training with images (slow), on the tiny random Llama 4 of test_llama4_vision.py: a train
step's loss on packed image-text rows equals the forward pass (checked against transformers in
test_llama4_vision_parity.py) run document by document; `--freeze vision` leaves the pixel-shuffle
tower alone; compiled for cpu-8 with fsdp, it trains and resumes bitwise."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from image_train_steps import (assert_freezing_the_tower_leaves_it_alone, compile_for_cpu8,  # noqa: E402
                               masked_nll, one_train_step, train_step_batch_shapes, trains_and_resumes_bitwise)
from test_llama4_vision import IMAGE_TOKENS, _tiny_spec  # noqa: E402

from mxc.runtime.data import ImagePackedSequences  # noqa: E402
from mxc.runtime.image_file import open_images, write_image_tokens  # noqa: E402
from mxc.runtime.token_file import open_tokens  # noqa: E402

pytestmark = pytest.mark.slow  # jit of the tiny MoE train step: a few minutes under load

PLACEHOLDER, BEGIN, END = (IMAGE_TOKENS[k] for k in ("image_token_index", "boi_token_index", "eoi_token_index"))
PER_IMAGE, EOD, VOCAB = 16, 2, 128


def _examples(count: int, seed: int):
    """Text, up to two images each followed by text; image k of the stream is random noise plus k."""
    rng = np.random.default_rng(seed)
    examples, image = [], 0
    for _ in range(count):
        parts = [rng.integers(3, 90, rng.integers(1, 8))]
        for _ in range(rng.integers(0, 3)):
            image += 1
            parts += [(rng.standard_normal((3, 32, 32)) + image).astype(np.float32), rng.integers(3, 90, rng.integers(1, 5))]
        examples.append(parts)
    return examples


def _runs(tokens: np.ndarray) -> int:
    placeholder = tokens == PLACEHOLDER
    return int(np.count_nonzero(placeholder & ~np.concatenate([[False], placeholder[:-1]])))


def _moved(params, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)


def _reference_loss(spec, params, rows) -> float:
    from mxc.compiler.lower.model import forward

    total, count = 0.0, 0
    for r in range(len(rows["inputs"])):
        images = iter(rows["pixel_values"][r][rows["image_mask"][r]])
        for segment in np.unique(rows["segment_ids"][r]):
            if segment == 0:
                continue
            where = np.flatnonzero(rows["segment_ids"][r] == segment)
            tokens = rows["inputs"][r, where]
            count_images = _runs(tokens)
            pixels = np.stack([next(images) for _ in range(count_images)]) if count_images else None
            logits, _ = forward(spec, params, jnp.asarray(tokens[None]),
                                pixel_values=None if pixels is None else jnp.asarray(pixels))
            nll, counted = masked_nll(logits[0], rows["targets"][r, where], rows["mask"][r, where])
            total, count = total + nll, count + counted
    return total / count


def _spec():
    return _tiny_spec().model_copy(update={"param_dtype": "float32", "compute_dtype": "float32"})


def _write(path, examples):
    write_image_tokens(path, examples, vocab_size=VOCAB, eod_id=EOD, placeholder=PLACEHOLDER,
                       tokens_per_image=PER_IMAGE, begin=BEGIN, end=END)


def _rows(tmp_path, count: int, seed: int):
    _write(tmp_path / "pairs.bin", _examples(count, seed))
    data = open_tokens(tmp_path / "pairs.bin")
    return ImagePackedSequences(data, open_images(data), 48, 2).rows(np.arange(4))


def test_the_steps_loss_equals_the_forward_pass_document_by_document(tmp_path):
    spec = _spec()
    rows = _rows(tmp_path, 12, seed=2)
    assert rows["image_mask"].sum() >= 3 and len(np.unique(rows["segment_ids"][0])) > 1
    state, after, metrics = one_train_step(spec, rows, remat="none", moved=lambda p: _moved(p, seed=3))
    # cross_entropy: the loss without the experts' load-balancing term
    assert float(metrics["cross_entropy"]) == pytest.approx(_reference_loss(spec, state.params, rows), abs=1e-5)
    assert not np.array_equal(state.params["vision"]["projector"]["kernel"], after.params["vision"]["projector"]["kernel"])


def test_freezing_the_tower_leaves_it_and_its_optimizer_state_alone(tmp_path):
    rows = _rows(tmp_path, 8, seed=3)
    assert rows["image_mask"].sum() >= 2
    assert_freezing_the_tower_leaves_it_alone(_spec(), rows, remat="none", moved=lambda p: _moved(p, seed=4))


def test_a_tiny_llama4_trains_on_cpu8_and_resumes_bitwise(tmp_path):
    from mxc.compiler.hf.spec_text import spec_text

    (tmp_path / "tiny.mspec").write_text(spec_text(_spec()))
    manifest = compile_for_cpu8(str(tmp_path / "tiny.mspec"), tmp_path / "artifact", "--seq", "32", "--batch", "8")
    assert train_step_batch_shapes(manifest)[("pixel_values",)] == [8, 1, 3, 32, 32]

    # Captions a model can only get right by looking: the image's brightness names the words.
    rng = np.random.default_rng(4)
    examples = []
    for _ in range(200):
        label = int(rng.integers(0, 4))
        image = (rng.standard_normal((3, 32, 32)) * 0.1 + (label - 1.5)).astype(np.float32)
        examples.append([np.asarray([3, 4]), image, np.asarray([20 + label, 30 + label, 40 + label])])
    _write(tmp_path / "pairs.bin", examples)
    losses = trains_and_resumes_bitwise(tmp_path / "artifact", tmp_path / "pairs.bin", tmp_path)
    assert losses[-5:].mean() < losses[:5].mean() - 0.5, losses
