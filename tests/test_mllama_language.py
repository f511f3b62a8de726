"""Llama 3.2 Vision in the language: cross_attention layers, the tiled tower, their counts,
parameter trees and located errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mxc.compiler.analysis import summarize
from mxc.compiler.kinds.vision import tokens_per_image
from mxc.compiler.lower.param_def import is_def
from mxc.compiler.lower.params import param_defs
from mxc.spec import SpecError, load_text
from mxc.spec.format import format_text
from mxc.spec.load import load_model

from located_errors import assert_refused_where_written  # noqa: E402


def test_zoo_models_have_their_layer_pattern_and_tower():
    spec = load_model("llama3.2-11b-vision")
    kinds = spec.layer_kinds
    assert [i for i, k in enumerate(kinds) if k == "cross"] == [3, 8, 13, 18, 23, 28, 33, 38]
    assert len(load_model("llama3.2-90b-vision").layer_kinds) == 100
    summary = summarize(spec)
    assert summary.vision_params == 863567379 + 31461376
    assert tokens_per_image(spec.vision) == 4 * 1601  # 40 x 40 patches and the class token per tile
    assert not spec.vision.entry.bidirectional  # the planner may pick splash for the text layers
    assert summary.embedding_params == 128264 * 4096  # 8 rows past the vocabulary


def test_parameter_tree_sums_to_the_count():
    spec = load_text(MODEL % "", "m.mspec")["n"]
    defs = param_defs(spec)
    total = sum(int(np.prod(d.shape)) for d in jax.tree.leaves(defs, is_leaf=is_def))
    assert total == summarize(spec).total_params
    cross = defs["segments"][0][1]["attention"]
    assert cross["k"]["kernel"].shape == (2, 32, 2, 8) and cross["attention_gate"].shape == (2,)
    assert defs["embed"]["embedding"].shape == (136, 32)


MODEL = """\
model m {
  vocab = 128
  d_model = 32
  max_seq = 64
  embedding = embedding(tied = false, extra_rows = 8)
  final_norm = rmsnorm(eps = 1e-5)
  block dense {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 8, rope = rope(theta = 10000))
    mlp = glu(hidden = 64, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  block cross {
    attention = cross_attention(heads = 4, kv_heads = 2, head_dim = 8, qk_norm = rmsnorm(eps = 1e-5))
    mlp = glu(hidden = 64, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = (dense, cross) x 2
  vision = vision(image = 16, d_model = 16, patches = patches(size = 4, stride = 4, bias = false),
                  positions = learned(),
                  block = encoder(attention = mha(heads = 2, head_dim = 8, rope = none),
                                  mlp = mlp(hidden = 32, act = gelu, bias = true),
                                  norm = layernorm(eps = 1e-5)),
                  layers = 3, final_norm = layernorm(eps = 1e-5), projector = linear(),
                  entry = cross_attention(token = 130), class_token = true, pre_norm = layernorm(eps = 1e-5),
                  tiles = tiles(max = 4, aspect_ratios = 8), global_layers = 2, intermediate = [0, 2])
}

model n extends m {
%s
}
"""


@pytest.mark.parametrize("line, needle, message", [
    ("vision.intermediate = [0, 3]", "3]", "intermediate layer 3 is not one of the 3"),
    ("block cross { attention.window = 8 }", "attention.window", "takes no window"),
    ("vision.projector = avg_pool(tokens = 4, norm = rmsnorm(eps = 1e-6))", "vision.projector",
     "does not fit Llama 3.2 Vision's tower"),
    ("vision.entry = placeholder(token = 127)", "vision.entry", "does not fit Llama 3.2 Vision's tower"),
    ("vision.tiles = none", "vision.tiles", "also needs tiles"),
    ("vision.entry.token = 136", "vision.entry.token", "outside the vocabulary (136)"),
    ("block cross { attention.kv_heads = 3 }", "attention.kv_heads", "not divisible"),
    ("vision.tiles = tile(max = 4, aspect_ratios = 8)", "tile(", "did you mean 'tiles'"),
])
def test_bad_values_are_errors_where_they_are_written(line, needle, message):
    assert_refused_where_written(MODEL % f"  {line}", line, needle, message)


def test_cross_attention_layers_need_a_cross_attention_tower():
    text = MODEL % ""
    text = text[:text.index("  vision = vision(")] + "}\n"
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    assert any("needs a vision tower whose entry is cross_attention" in d.message for d in err.value.diagnostics)


def test_the_model_formats_to_a_fixed_point_with_the_same_model():
    canonical = format_text(MODEL % "", "m.mspec")
    assert format_text(canonical, "m.mspec") == canonical
    assert load_text(canonical, "m.mspec")["m"] == load_text(MODEL % "", "m.mspec")["m"]
