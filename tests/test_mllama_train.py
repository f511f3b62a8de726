"""Llama 3.2 Vision (mllama) training with images: tiled images beside a token file, the
cross-attention mask a packed row gives each token (against MllamaProcessor's own functions), and
(slow) a train step's loss against the forward pass document by document, `--freeze vision` on the
tiled tower, and a tiny mllama compiled for cpu-8 with fsdp that trains on synthetic image-text
pairs with a falling loss and resumes bitwise."""

import os
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from image_train_steps import (assert_freezing_the_tower_leaves_it_alone, compile_for_cpu8, masked_nll,
                               one_train_step, train_step_batch_shapes, trains_and_resumes_bitwise)
from mxc.runtime.data import ImagePackedSequences
from mxc.runtime.image_file import TiledImage, open_images, write_image_tokens
from mxc.runtime.token_file import open_tokens
from mxc.spec import load_text

# Llama 3.2 Vision's blocks and tower, shrunk: 3 text layers (the middle one cross-attention), 8-pixel
# tiles of 4-pixel patches (5 tokens a tile, class token first), up to 2 tiles in 3 arrangements
# ((1,1), (1,2), (2,1): ids 1, 2, 3), 2 local layers keeping layer 0, 1 global layer.
TINY = """\
model mllama-tiny {
  vocab = 64
  d_model = 32
  max_seq = 64
  embedding = embedding(tied = false, extra_rows = 8)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = float32
  block dense {
    attention = gqa(heads = 2, kv_heads = 1, head_dim = 16, rope = rope(theta = 10000))
    mlp = glu(hidden = 64, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block cross {
    attention = cross_attention(heads = 2, kv_heads = 1, head_dim = 16, qk_norm = rmsnorm(eps = 1e-5))
    mlp = glu(hidden = 64, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = dense, cross, dense
  vision = vision(image = 8, d_model = 16,
                  patches = patches(size = 4, stride = 4, channels = 3, bias = false),
                  positions = learned(),
                  block = encoder(attention = mha(heads = 2, head_dim = 8, rope = none),
                                  mlp = mlp(hidden = 32, act = gelu, bias = true),
                                  norm = layernorm(eps = 1e-5)),
                  layers = 2, final_norm = layernorm(eps = 1e-5), projector = linear(),
                  entry = cross_attention(token = 63), class_token = true,
                  pre_norm = layernorm(eps = 1e-5),
                  tiles = tiles(max = 2, aspect_ratios = 3), global_layers = 1, intermediate = [0])
}
"""
IMAGE, EOD, VOCAB, TILES = 63, 0, 64, 2
TILE_COUNTS = {1: 1, 2: 2, 3: 2}  # aspect-ratio id -> tiles


@pytest.fixture(scope="module")
def spec():
    return load_text(TINY, "tiny.mspec")["mllama-tiny"]


def _image(value: float, aspect_ratio_id: int) -> TiledImage:
    pixels = np.zeros((TILES, 3, 8, 8), np.float32)
    pixels[:TILE_COUNTS[aspect_ratio_id]] = value
    return TiledImage(pixels, aspect_ratio_id)


def _examples(count: int, seed: int):
    """Synthetic pairs: text, then up to two images (sometimes adjacent, as the processor writes
    several images before one text) each followed by text; image k of the stream holds the value
    k + 1 in its tiles, so a slot's pixels say which image it holds."""
    rng = np.random.default_rng(seed)
    examples, image = [], 0
    for _ in range(count):
        parts = [rng.integers(10, IMAGE, rng.integers(1, 6))]
        for _ in range(rng.integers(0, 3)):
            image += 1
            parts.append(_image(float(image), int(rng.integers(1, 4))))
            if rng.random() < 0.7:
                parts.append(rng.integers(10, IMAGE, rng.integers(1, 5)))
        examples.append(parts)
    return examples


def _write(path, examples):
    return write_image_tokens(path, examples, vocab_size=VOCAB, eod_id=EOD, placeholder=IMAGE, tokens_per_image=1)


def _packed(tmp_path, count, seed, seq=16, slots=2):
    _write(tmp_path / "pairs.bin", _examples(count, seed))
    data = open_tokens(tmp_path / "pairs.bin")
    packed = ImagePackedSequences(data, open_images(data), seq, slots)
    return packed, packed.rows(np.arange(packed.count))


def test_rows_carry_tiled_images_and_their_arrangements(tmp_path):
    packed, rows = _packed(tmp_path, 30, seed=0)
    assert rows["pixel_values"].shape[1:] == (2, TILES, 3, 8, 8) and rows["aspect_ratio_ids"].dtype == np.int32
    seen = []
    for r in range(packed.count):
        held = int(rows["image_mask"][r].sum())
        assert held == np.count_nonzero(rows["inputs"][r] == IMAGE)
        for k in range(held):
            value, ratio = rows["pixel_values"][r, k, 0, 0, 0, 0], int(rows["aspect_ratio_ids"][r, k])
            tiles = TILE_COUNTS[ratio]
            assert np.all(rows["pixel_values"][r, k, :tiles] == value)
            assert np.all(rows["pixel_values"][r, k, tiles:] == 0)
            seen.append(int(value))
        assert np.all(rows["aspect_ratio_ids"][r, held:] == 0)
    assert seen == list(range(1, len(seen) + 1)) and len(seen) > 10


def _processor_mask(tokens: np.ndarray, tile_counts: list[int]) -> np.ndarray:
    """[len(tokens), images, TILES]: MllamaProcessor's cross_attention_mask for one document."""
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    sparse = get_cross_attention_token_mask(list(tokens), IMAGE)
    return convert_sparse_cross_attention_mask_to_dense([sparse], [tile_counts], TILES, len(tokens))[0]


def _documents(rows, r):
    """(token indices, slot indices) of each document of row r, in order."""
    slot = 0
    for segment in np.unique(rows["segment_ids"][r]):
        if segment == 0:  # padding
            continue
        where = np.flatnonzero(rows["segment_ids"][r] == segment)
        count = int(np.count_nonzero(rows["inputs"][r, where] == IMAGE))
        yield where, list(range(slot, slot + count))
        slot += count


def test_each_tokens_cross_attention_mask_is_the_processors_for_its_document(tmp_path, spec):
    pytest.importorskip("transformers")
    from mxc.compiler.lower.image_slots import cross_masks

    packed, rows = _packed(tmp_path, 40, seed=1, seq=24, slots=3)
    allowed, same_document, _ = jax.jit(lambda *a: cross_masks(spec, *a, TILES))(
        rows["inputs"], rows["segment_ids"], rows["image_mask"], rows["aspect_ratio_ids"])
    allowed, same_document = np.asarray(allowed), np.asarray(same_document)
    adjacent = checked = 0
    for r in range(packed.count):
        for where, slots in _documents(rows, r):
            tokens = rows["inputs"][r, where]
            adjacent += bool(np.any((tokens[1:] == IMAGE) & (tokens[:-1] == IMAGE)))
            others = [k for k in range(3) if k not in slots]
            assert not allowed[r][np.ix_(where, others)].any() and not same_document[r][np.ix_(where, others)].any()
            if not slots:
                continue
            counts = [TILE_COUNTS[int(rows["aspect_ratio_ids"][r, k])] for k in slots]
            np.testing.assert_array_equal(allowed[r][np.ix_(where, slots)], _processor_mask(tokens, counts))
            assert same_document[r][np.ix_(where, slots)].all()
            checked += 1
    assert checked > 10 and adjacent > 0  # adjacent image tokens are seen together


def _moved(params, seed: int):
    """Every weight moved off its initial value, the gates (zero at initialisation, which would
    switch the image layers and the tower's tile tables off) to random values."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    moved = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if "gate" in name:
            moved.append(jnp.asarray(rng.uniform(-1, 1, leaf.shape), leaf.dtype))
        else:
            moved.append(leaf + jnp.asarray(0.05 * rng.standard_normal(leaf.shape), leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, moved)


def _reference_loss(spec, params, rows) -> float:
    """The packed batch's loss recomputed document by document through the forward pass with the
    processor's inputs (cross_attention.forward, checked against transformers in
    test_mllama_parity.py), the mask from MllamaProcessor's functions, cross-entropy in numpy."""
    from mxc.compiler.lower import cross_attention

    total, count = 0.0, 0
    for r in range(len(rows["inputs"])):
        for where, slots in _documents(rows, r):
            tokens = jnp.asarray(rows["inputs"][r, where][None])
            if slots:
                ids = rows["aspect_ratio_ids"][r, slots]
                counts = [TILE_COUNTS[int(i)] for i in ids]
                logits = cross_attention.forward_with_inputs(
                    spec, params, tokens, pixel_values=jnp.asarray(rows["pixel_values"][r, slots][None]),
                    aspect_ratio_ids=jnp.asarray(ids[None]),
                    aspect_ratio_mask=jnp.asarray((np.arange(TILES)[None] < np.asarray(counts)[:, None])[None]),
                    cross_attention_mask=jnp.asarray(_processor_mask(rows["inputs"][r, where], counts)[None]))
            else:
                logits, _ = cross_attention.forward(spec, params, tokens)
            nll, counted = masked_nll(logits[0], rows["targets"][r, where], rows["mask"][r, where])
            total, count = total + nll, count + counted
    return total / count


@pytest.mark.slow  # jit of the tiny train step and the reference forwards: about a minute under load
def test_the_steps_loss_equals_the_forward_pass_document_by_document(tmp_path, spec):
    pytest.importorskip("transformers")
    packed, rows = _packed(tmp_path, 16, seed=2, seq=24, slots=3)
    rows = {k: v[:4] for k, v in rows.items()}
    documents = [slots for r in range(4) for _, slots in _documents(rows, r)]
    assert any(len(s) == 0 for s in documents) and any(len(s) == 2 for s in documents)
    # full remat: the tower's encoder layers and the text's run rematerialised, as the planner's plans run them
    state, after, metrics = one_train_step(spec, rows, remat="full", moved=lambda p: _moved(p, seed=3))
    assert float(metrics["loss"]) == pytest.approx(_reference_loss(spec, state.params, rows), abs=1e-5)
    # the tower learns through the cross layers
    assert not np.array_equal(state.params["vision"]["projector"]["kernel"], after.params["vision"]["projector"]["kernel"])


@pytest.mark.slow  # jit of the tiny train step: about a minute under load
def test_freezing_the_tower_leaves_it_and_its_optimizer_state_alone(tmp_path, spec):
    _, rows = _packed(tmp_path, 16, seed=2, seq=24, slots=3)
    rows = {k: v[:4] for k, v in rows.items()}
    assert rows["image_mask"].sum() >= 2
    # the gates moved off zero, so that the cross layers (and a trained tower) would change the loss
    assert_freezing_the_tower_leaves_it_alone(spec, rows, remat="full", moved=lambda p: _moved(p, seed=3))


@pytest.mark.slow  # a plan, a cpu-8 compile and three runs of 30 steps: about 5 min under load
def test_a_tiny_mllama_plans_compiles_for_cpu8_trains_and_resumes_bitwise(tmp_path):
    from runtime_support import MXC, cpu_env

    (tmp_path / "tiny.mspec").write_text(TINY)
    model = f"{tmp_path / 'tiny.mspec'}:mllama-tiny"
    planned = subprocess.run([MXC, "plan", model, "--topology", "cpu-8", "--seq", "16", "--batch", "8",
                              "--pin", "fsdp=8", "--json"], env=cpu_env(8), capture_output=True, text=True,
                             timeout=900)
    assert planned.returncode == 0, planned.stderr[-4000:]
    manifest = compile_for_cpu8(model, tmp_path / "artifact", "--seq", "16", "--batch", "8", "--images-per-row", "2")
    shapes = train_step_batch_shapes(manifest)
    assert shapes[("pixel_values",)] == [8, 2, TILES, 3, 8, 8] and shapes[("aspect_ratio_ids",)] == [8, 2]

    # Captions a model can only get right by looking: the image's brightness names the words.
    rng = np.random.default_rng(4)
    examples = []
    for _ in range(200):
        label, ratio = int(rng.integers(0, 4)), int(rng.integers(1, 4))
        pixels = np.zeros((TILES, 3, 8, 8), np.float32)
        pixels[:TILE_COUNTS[ratio]] = rng.standard_normal((TILE_COUNTS[ratio], 3, 8, 8)) * 0.1 + (label - 1.5)
        examples.append([np.asarray([1, 2]), TiledImage(pixels, ratio),
                         np.asarray([20 + label, 30 + label, 40 + label])])
    _write(tmp_path / "pairs.bin", examples)
    losses = trains_and_resumes_bitwise(tmp_path / "artifact", tmp_path / "pairs.bin", tmp_path)
    assert losses[-5:].mean() < losses[:5].mean() - 1.0, losses
