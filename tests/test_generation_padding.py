"""Prompts shorter than the prefill, of different lengths in one batch: the generation driver with
the model functions of compiler/lower/decode.py gives exactly the tokens of a greedy decode that
re-runs the full forward over each unpadded row for every new token (no cache, no padding).

One model mixes the attention kinds whose masks depend on positions: a sliding window with sinks,
chunked attention without rope, and global attention; the other is MLA (mla-tiny), which caches
compressed latents instead of keys and values."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.commands.generate import spec_servable
from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import param_shapes
from mxc.runtime.generate import PAD, GenerationError, generate
from mxc.spec.load import load_model, load_text

WINDOWED = """
model windowed {
  vocab = 61
  d_model = 32
  max_seq = 64
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  compute_dtype = float32
  block local {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 8, window = 3, sinks = true, rope = rope(theta = 10000))
    mlp = glu(hidden = 48, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block global {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 8, rope = rope(theta = 10000))
    mlp = glu(hidden = 48, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block chunked {
    attention = gqa(heads = 4, kv_heads = 1, head_dim = 8, chunk = 4, rope = none)
    mlp = glu(hidden = 48, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = local, chunked, global, local
}
"""


def _random_params(spec, std=0.3):
    """Every weight drawn at random (norm scales around 1): sharp enough logits that greedy
    choices are far from ties."""
    rng = np.random.default_rng(0)

    def draw(path, shape):
        centre = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(centre + std * rng.normal(size=shape.shape), shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(spec))


def _reference_greedy(spec, params, prompt: list[int], max_new: int) -> list[int]:
    """Argmax of the full forward over the unpadded sequence so far, one new token at a time."""
    run = jax.jit(lambda p, t: forward(spec, p, t, dtype="float32")[0][0, -1])
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(jnp.argmax(run(params, jnp.asarray([tokens], jnp.int32)))))
    return tokens[len(prompt):]


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    prompts = np.full((len(rows), width), PAD, np.int32)
    for i, row in enumerate(rows):
        prompts[i, :len(row)] = row
    return prompts


@pytest.mark.parametrize("model", ["windowed", pytest.param("mla-tiny", marks=pytest.mark.slow)])
def test_short_prompts_of_mixed_lengths_give_the_unpadded_greedy_tokens(model):
    spec = load_text(WINDOWED)["windowed"] if model == "windowed" else load_model(model)
    params = _random_params(spec)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, spec.vocab, n).tolist() for n in (2, 7, 5)]
    max_new, prompt_len = 6, 8
    # Two rows per group: the second group holds one request, filled with a copy of it.
    servable = spec_servable(spec, 2, prompt_len, prompt_len + max_new - 1, "float32")
    tokens, report = generate(servable, params, _padded(rows, 7), max_new)
    assert tokens.shape == (3, 7 + max_new) and report.groups == 2 and report.prompt_tokens == 7
    np.testing.assert_array_equal(tokens[:, :7], _padded(rows, 7))
    for i, row in enumerate(rows):
        assert tokens[i, 7:].tolist() == _reference_greedy(spec, params, row, max_new), i


@pytest.mark.parametrize("model", ["windowed", pytest.param("mla-tiny", marks=pytest.mark.slow)])
def test_prompts_longer_than_the_prefill_are_fed_through_decode_steps(model):
    """Rows past prompt_len go on through decode steps while the shorter rows of their group already
    generate: each still gets the unpadded greedy tokens."""
    spec = load_text(WINDOWED)["windowed"] if model == "windowed" else load_model(model)
    params = _random_params(spec)
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, spec.vocab, n).tolist() for n in (3, 11, 4, 9)]
    max_new, prompt_len = 5, 4
    servable = spec_servable(spec, 2, prompt_len, 11 + max_new - 1, "float32")
    tokens, report = generate(servable, params, _padded(rows, 11), max_new)
    assert report.prompt_tokens == 11
    for i, row in enumerate(rows):
        assert tokens[i, 11:].tolist() == _reference_greedy(spec, params, row, max_new), i


def test_an_empty_prompt_and_one_the_cache_cannot_hold_are_refused():
    spec = load_text(WINDOWED)["windowed"]
    servable = spec_servable(spec, 2, 4, 8, "float32")
    with pytest.raises(GenerationError, match="prompt row 1 is empty: every prompt needs at least one token"):
        generate(servable, {}, _padded([[1, 2], []], 3), 2)
    with pytest.raises(GenerationError, match=r"8 prompt slots \+ 2 new tokens need a cache of 9 slots; "
                                              r"the compiled cache holds 8"):
        generate(servable, {}, _padded([[1, 2], [1, 2, 3, 4, 5, 6, 7, 8]], 8), 2)
    with pytest.raises(GenerationError, match="prompt row 0 has ids after its padding"):
        generate(servable, {}, np.array([[1, PAD, 2]], np.int32), 2)
