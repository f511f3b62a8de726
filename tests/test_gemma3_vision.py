"""Gemma 3 with images: the vision tower in the language, its counts, and (below) parity with
transformers' Gemma3ForConditionalGeneration on tiny random models."""

import json
from pathlib import Path

import pytest

from mxc.compiler.analysis import summarize
from mxc.spec import SpecError, load_text
from mxc.spec.format import format_text
from mxc.spec.load import load_model

REFERENCE = Path(__file__).resolve().parent / "data" / "param_counts.json"


def _reference(zoo: str) -> dict:
    return next(e for e in json.loads(REFERENCE.read_text()) if e["zoo"] == zoo)


@pytest.mark.parametrize("size", ["4b", "12b", "27b"])
def test_gemma3_with_its_tower_counts_what_transformers_counts(size):
    full, text = summarize(load_model(f"gemma3-{size}")), summarize(load_model(f"gemma3-{size}-text"))
    ref = _reference(f"gemma3-{size}")
    assert ref["hf_class"] == "Gemma3ForConditionalGeneration"
    assert full.total_params == ref["total_params"]
    assert full.vision_params == ref["vision_tower_params"] + ref["projector_params"]
    assert full.total_params == text.total_params + full.vision_params
    assert text.vision_params == 0 and "vision" not in load_model(f"gemma3-{size}-text").model_dump()


def test_the_so400m_tower_reads_as_the_paper_states_it():
    tower = load_model("gemma3-27b").vision
    assert (tower.layers, tower.d_model, tower.block.mlp.hidden, tower.block.attention.heads) == (27, 1152, 4304, 16)
    assert (tower.patches.size, tower.image, tower.num_patches, tower.projector.tokens) == (14, 896, 4096, 256)


TOWER = """\
model m extends gemma3-1b {
  vision = vision(image = 28, d_model = 32, patches = patches(size = 7, stride = 7),
                  positions = learned(),
                  block = encoder(attention = mha(heads = 2, head_dim = 16, rope = none, qkv_bias = true,
                                                  out_bias = true),
                                  mlp = mlp(hidden = 64, act = gelu_tanh, bias = true),
                                  norm = layernorm(eps = 1e-6)),
                  layers = 2, final_norm = layernorm(eps = 1e-6),
                  projector = avg_pool(tokens = 4, norm = rmsnorm(eps = 1e-6, zero_centered = true)),
                  entry = placeholder(token = 7, begin = 5, end = 6, bidirectional = true))
%s
}
"""


def test_a_tower_formats_to_a_fixed_point_with_the_same_model():
    text = TOWER % ""
    canonical = format_text(text, "m.mspec")
    assert format_text(canonical, "m.mspec") == canonical
    assert load_text(canonical, "m.mspec")["m"] == load_text(text, "m.mspec")["m"]


@pytest.mark.parametrize("line, needle, message", [
    ("vision.patches.stride = 5", "vision.patches.stride", "do not tile an image of 28"),
    ("vision.patches.size = 29", "vision.patches.size", "larger than the image"),
    ("vision.projector.tokens = 3", "vision.projector.tokens", "must be a square number"),
    ("vision.projector.tokens = 9", "vision.projector.tokens", "does not pool evenly"),
    ("vision.entry.token = 262144", "vision.entry.token", "outside the vocabulary"),
    ("vision.block.attention.window = 4", "vision.block.attention.window", "sees the whole image"),
    ("vision.projector = pool(tokens = 4)", "pool(", "did you mean 'avg_pool'"),
])
def test_bad_tower_values_are_errors_where_they_are_written(line, needle, message):
    text = TOWER % f"  {line}"
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    found = [d for d in err.value.diagnostics if message in d.message + (d.hint or "")]
    assert found, [d.message for d in err.value.diagnostics]
    row = text.count("\n", 0, text.index(line)) + 1
    col = text.split("\n")[row - 1].index(needle) + 1
    assert (found[0].loc.line, found[0].loc.col) == (row, col)
