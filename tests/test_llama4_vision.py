"""Llama 4's vision tower and projector against transformers' Llama4VisionModel and
Llama4MultiModalProjector on a tiny random configuration (float32)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxc.compiler.hf.config_in import ConfigError  # noqa: E402
from mxc.compiler.hf.llama4_vision import config_from_tower, tower_from_config  # noqa: E402
from mxc.compiler.hf.llama4_vision import vision_tensor_maps as tensor_maps  # noqa: E402
from mxc.compiler.kinds import vision as vision_kind  # noqa: E402
from mxc.compiler.lower import vision_llama4  # noqa: E402
from mxc.compiler.lower.param_def import is_def  # noqa: E402

from located_errors import assert_refused_where_written  # noqa: E402

TEXT_D_MODEL = 64
# 32-pixel images of 4-pixel patches: 64 patches, 16 tokens after the pixel shuffle; 4 heads of 8.
VISION = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_attention_heads=4,
              intermediate_size=128, num_hidden_layers=2, norm_eps=1e-5, pixel_shuffle_ratio=0.5,
              projector_input_dim=40, projector_output_dim=40, vision_output_dim=40,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
TEXT = dict(vocab_size=128, hidden_size=TEXT_D_MODEL, intermediate_size=64, intermediate_size_mlp=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=2, attention_chunk_size=16, no_rope_layers=[1, 0])
IMAGE_TOKENS = dict(image_token_index=100, boi_token_index=98, eoi_token_index=99)


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Llama4Config(vision_config=VISION, text_config=TEXT, **IMAGE_TOKENS)
    config._attn_implementation = "eager"
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Random norms and biases too, so that a swapped scale or bias shows.
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _tiny_spec():
    from mxc.compiler.hf.llama4 import spec_from_config

    text = spec_from_config(transformers.Llama4TextConfig(**TEXT).to_dict(), "tiny")
    return text.model_copy(update={"vision": tower_from_config({"vision_config": VISION, **IMAGE_TOKENS})})


def _vision_params(spec, state: dict) -> dict:
    defs = {"vision": vision_kind.param_defs(spec)}
    params = jax.tree.map(lambda d: np.zeros(d.shape, np.float32), defs, is_leaf=is_def)
    for tensor_map in tensor_maps(spec):
        tensor_map.write(params, state[tensor_map.hf_name])
    return params


@pytest.fixture(scope="module")
def tiny():
    model = _hf_model()
    spec = _tiny_spec()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()
             if k.startswith(("vision_model.", "multi_modal_projector."))}
    return model, spec, state, _vision_params(spec, state)


def test_maps_cover_every_hf_tensor_and_round_trip(tiny):
    _, spec, state, params = tiny
    maps = list(tensor_maps(spec))
    assert sorted(m.hf_name for m in maps) == sorted(state)
    for m in maps:
        np.testing.assert_array_equal(m.read(params), state[m.hf_name])
    assert tower_from_config(config_from_tower(spec.vision)) == spec.vision


def test_tower_and_projector_match_transformers(tiny):
    model, spec, _, params = tiny
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        features = model.vision_model(torch.from_numpy(pixels)).last_hidden_state
        projected = model.multi_modal_projector(features)
    ours = jax.jit(lambda p, x: vision_llama4.adapter_output(spec.vision, p["vision"], x, np.float32))(params, pixels)
    assert ours.shape == (2, vision_kind.tokens_per_image(spec.vision), 40) == tuple(features.shape)
    np.testing.assert_allclose(np.asarray(ours), features.numpy(), atol=1e-4, rtol=0)
    embedded = jax.jit(lambda p, x: vision_llama4.encode_images(spec, p, x, np.float32))(params, pixels)
    assert embedded.shape == (2, 16, TEXT_D_MODEL)
    np.testing.assert_allclose(np.asarray(embedded), projected.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("change", [{"class_token": False}, {"pre_norm": None}, {"rope": None}])
def test_export_refuses_a_pixel_shuffle_tower_that_is_not_llama4s(change):
    from mxc.compiler.hf.mapping import LayoutError

    with pytest.raises(LayoutError, match="not Llama 4's"):
        config_from_tower(_tiny_spec().vision.model_copy(update=change))


def test_rope_2d_angles_match_transformers():
    from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

    config = transformers.Llama4VisionConfig(**VISION)
    reference = Llama4VisionRotaryEmbedding(config).freqs_ci[:, 0, :]  # [patches + 1, head_dim // 2]
    angles = vision_llama4.rope_2d_angles(_tiny_spec().vision)
    np.testing.assert_allclose(np.cos(angles), reference.real.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.sin(angles), reference.imag.numpy(), atol=1e-6)


def test_pixel_shuffle_matches_transformers():
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle

    x = np.random.default_rng(1).standard_normal((2, 64, 12)).astype(np.float32)
    expected = pixel_shuffle(torch.from_numpy(x), 0.5).numpy()
    np.testing.assert_array_equal(np.asarray(vision_llama4.pixel_shuffle(x, 0.5)), expected)


@pytest.mark.parametrize("change, message", [
    ({"intermediate_size": 64}, "intermediate_size 64 must equal"),
    ({"vision_output_dim": 48}, "vision_output_dim 48 must equal"),
    ({"projector_output_dim": 48}, "projector_output_dim 48 must equal"),
    ({"image_size": [32, 16]}, "square images"),
])
def test_configs_mxc_cannot_express_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        tower_from_config({"vision_config": {**VISION, **change}})


# ---------------------------------------------------------------- the tower in the language

def _reference(zoo: str) -> dict:
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent / "data" / "param_counts.json"
    return next(e for e in json.loads(path.read_text()) if e["zoo"] == zoo)


@pytest.mark.parametrize("name", ["llama4-17b-16e", "llama4-17b-128e"])
def test_llama4_with_its_tower_counts_what_transformers_counts(name):
    from mxc.compiler.analysis import summarize
    from mxc.spec.load import load_model

    full, text = summarize(load_model(name)), summarize(load_model(f"{name}-text"))
    ref = _reference(name)
    assert ref["hf_class"] == "Llama4ForConditionalGeneration"
    assert full.total_params == ref["total_params"]
    assert full.vision_params == ref["vision_tower_params"] + ref["projector_params"]
    assert full.total_params == text.total_params + full.vision_params
    assert full.active_params == text.active_params + full.vision_params == ref["active_params"]


def test_the_zoo_tower_has_transformers_sizes():
    from mxc.compiler.kinds.vision import tokens_per_image
    from mxc.spec.load import load_model

    tower = load_model("llama4-17b-16e").vision
    assert (tower.num_patches, tokens_per_image(tower), tower.projector.adapter) == (576, 144, 4096)


TOWER = """\
model m extends llama4-17b-16e-text {
  vision = vision(image = 32, d_model = 32, patches = patches(size = 4, stride = 4, bias = false),
                  positions = learned(),
                  block = encoder(attention = mha(heads = 4, head_dim = 8, rope = none, qkv_bias = true,
                                                  out_bias = true),
                                  mlp = mlp(hidden = 128, act = gelu, bias = true),
                                  norm = layernorm(eps = 1e-5)),
                  layers = 2, final_norm = layernorm(eps = 1e-5),
                  projector = pixel_shuffle(ratio = 0.5, adapter = 40),
                  entry = placeholder(token = 100, begin = 98, end = 99),
                  class_token = true, pre_norm = layernorm(eps = 1e-5), rope = rope_2d(theta = 10000))
%s
}
"""


@pytest.mark.parametrize("line, needle, message", [
    ("vision.projector.ratio = 0.3", "vision.projector.ratio", "a pixel shuffle of ratio 0.3"),
    ("vision.block.attention.head_dim = 6", "vision.block.attention.head_dim", "not a multiple of 4"),
    ("vision.block.attention.rope = rope(theta = 10000)", "vision.block.attention.rope", "already rotates"),
    ("vision.rope = rope2d(theta = 1)", "rope2d(", "did you mean 'rope_2d'"),
])
def test_bad_llama4_tower_values_are_errors_where_they_are_written(line, needle, message):
    assert_refused_where_written(TOWER % f"  {line}", line, needle, message)


def test_a_llama4_tower_formats_to_a_fixed_point_with_the_same_model():
    from mxc.spec import load_text
    from mxc.spec.format import format_text

    canonical = format_text(TOWER % "", "m.mspec")
    assert format_text(canonical, "m.mspec") == canonical
    assert load_text(canonical, "m.mspec")["m"] == load_text(TOWER % "", "m.mspec")["m"]
