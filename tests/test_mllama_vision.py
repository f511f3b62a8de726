"""Llama 3.2 Vision's (mllama's) vision tower and projector against transformers'
MllamaVisionModel and multi_modal_projector on a tiny random configuration (float32)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxc.compiler.hf.mllama import params_from_state, tower_from_config, vision_tensor_maps  # noqa: E402
from mxc.compiler.lower import vision_mllama  # noqa: E402

# 16-pixel tiles of 4-pixel patches: 17 tokens per tile (class token first), padded to 24; up to
# 4 tiles; local layers 0 and 2 kept beside the global output: 3 x 32 = 96 features per token.
VISION = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, attention_heads=4,
              intermediate_size=64, num_hidden_layers=3, num_global_layers=2, max_num_tiles=4,
              intermediate_layers_indices=[0, 2], vision_output_dim=96, norm_eps=1e-5)
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, cross_attention_layers=[1, 3], rms_norm_eps=1e-5, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
TOWER = tower_from_config({"vision_config": VISION, "image_token_index": 127})

# Two images: 2x2 tiles (aspect ratio id 6) and 1x2 tiles (id 2, the last two tiles padding).
ASPECT_RATIO_IDS = np.array([6, 2])
ASPECT_RATIO_MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.MllamaConfig(vision_config=VISION, text_config=TEXT, image_token_index=127)
    config._attn_implementation = "eager"
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Random norms, biases and gates too, so that a swapped scale, bias or gate shows.
        for name, p in model.named_parameters():
            if "gate" in name:
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            else:
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def tiny():
    model = _hf_model()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()
             if k.startswith(("model.vision_model.", "model.multi_modal_projector."))}
    pixels = np.random.default_rng(0).standard_normal((1, 2, 4, 3, 16, 16)).astype(np.float32)
    return model, state, params_from_state(vision_tensor_maps(TOWER, "model."), state), pixels


def test_maps_cover_every_hf_tensor_and_round_trip(tiny):
    _, state, params, _ = tiny
    maps = list(vision_tensor_maps(TOWER, "model."))
    assert sorted(m.hf_name for m in maps) == sorted(state)
    for m in maps:
        np.testing.assert_array_equal(m.read(params), state[m.hf_name])


def _hf_outputs(model, pixels):
    with torch.no_grad():
        features = model.model.vision_model(pixel_values=torch.from_numpy(pixels),
                                            aspect_ratio_ids=torch.from_numpy(ASPECT_RATIO_IDS[None]),
                                            aspect_ratio_mask=torch.from_numpy(ASPECT_RATIO_MASK[None]))
        features = features.last_hidden_state
        projected = model.model.multi_modal_projector(features)
    return features.numpy()[0], projected.numpy()[0]


def _mxc_outputs(params, pixels):
    vp = jax.tree.map(jax.numpy.asarray, params["vision"])
    features = vision_mllama.encode_tiles(TOWER, vp, pixels[0], ASPECT_RATIO_IDS, ASPECT_RATIO_MASK,
                                          jax.numpy.float32)
    return np.asarray(features), np.asarray(vision_mllama.project_tiles(vp, features, jax.numpy.float32))


def test_tower_and_projector_match_transformers(tiny):
    model, _, params, pixels = tiny
    hf_features, hf_projected = _hf_outputs(model, pixels)
    features, projected = _mxc_outputs(params, pixels)
    assert features.shape == hf_features.shape == (2, 4, 17, 96)
    np.testing.assert_allclose(features, hf_features, atol=1e-4, rtol=0)
    np.testing.assert_allclose(projected, hf_projected.reshape(2, 4 * 17, 64), atol=1e-4, rtol=0)


def test_padding_is_transformers_mask():
    """Only a pair of padding tokens is kept apart; the dropped tiles are padding throughout."""
    padding = np.asarray(vision_mllama.padding_positions(TOWER, ASPECT_RATIO_MASK))
    assert padding.shape == (2, 4 * 24)
    tiles = padding.reshape(2, 4, 24)
    assert not tiles[0, :, :17].any() and tiles[0, :, 17:].all()
    assert tiles[1, 2:].all() and not tiles[1, :2, :17].any()
