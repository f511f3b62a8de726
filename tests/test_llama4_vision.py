"""Llama 4's vision tower and projector against transformers' Llama4VisionModel and
Llama4MultiModalProjector on a tiny random configuration (float32)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mxc.compiler.hf.llama4_vision import config_from_vision, tensor_maps, vision_from_config  # noqa: E402
from mxc.compiler.hf.config_in import ConfigError  # noqa: E402
from mxc.compiler.lower import vision_llama4  # noqa: E402
from mxc.compiler.lower.param_def import is_def  # noqa: E402

TEXT_D_MODEL = 64
# 32-pixel images of 4-pixel patches: 64 patches, 16 tokens after the pixel shuffle; 4 heads of 8.
VISION = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_attention_heads=4,
              intermediate_size=128, num_hidden_layers=2, norm_eps=1e-5, pixel_shuffle_ratio=0.5,
              projector_input_dim=40, projector_output_dim=40, vision_output_dim=40,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
TEXT = dict(vocab_size=128, hidden_size=TEXT_D_MODEL, intermediate_size=64, intermediate_size_mlp=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=2, attention_chunk_size=16)


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Llama4Config(vision_config=VISION, text_config=TEXT, image_token_index=100)
    config._attn_implementation = "eager"
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Random norms and biases too, so that a swapped scale or bias shows.
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _mxc_params(vision, state: dict) -> dict:
    defs = vision_llama4.param_defs(vision)
    params = jax.tree.map(lambda d: np.zeros(d.shape, np.float32), defs, is_leaf=is_def)
    for tensor_map in tensor_maps(vision):
        tensor_map.write(params, state[tensor_map.hf_name])
    return params


@pytest.fixture(scope="module")
def tiny():
    model = _hf_model()
    vision = vision_from_config(VISION, TEXT_D_MODEL)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()
             if k.startswith(("vision_model.", "multi_modal_projector."))}
    return model, vision, state, _mxc_params(vision, state)


def test_maps_cover_every_hf_tensor_and_round_trip(tiny):
    _, vision, state, params = tiny
    maps = list(tensor_maps(vision))
    assert sorted(m.hf_name for m in maps) == sorted(state)
    for m in maps:
        np.testing.assert_array_equal(m.read(params), state[m.hf_name])
    assert vision_from_config(config_from_vision(vision), TEXT_D_MODEL) == vision


def test_tower_and_projector_match_transformers(tiny):
    model, vision, _, params = tiny
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        features = model.vision_model(torch.from_numpy(pixels)).last_hidden_state
        projected = model.multi_modal_projector(features)
    ours = jax.jit(lambda p, x: vision_llama4.encode_images(vision, p, x))(params, pixels)
    assert ours.shape == (2, vision.tokens_per_image, 40) == tuple(features.shape)
    np.testing.assert_allclose(np.asarray(ours), features.numpy(), atol=1e-4, rtol=0)
    embedded = jax.jit(lambda p, x: vision_llama4.image_embeddings(vision, p, x))(params, pixels)
    assert embedded.shape == (2, 16, TEXT_D_MODEL)
    np.testing.assert_allclose(np.asarray(embedded), projected.numpy(), atol=1e-4, rtol=0)


def test_rope_2d_angles_match_transformers():
    from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

    config = transformers.Llama4VisionConfig(**VISION)
    reference = Llama4VisionRotaryEmbedding(config).freqs_ci[:, 0, :]  # [patches + 1, head_dim // 2]
    angles = vision_llama4.rope_2d_angles(vision_from_config(VISION, TEXT_D_MODEL))
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
        vision_from_config({**VISION, **change}, TEXT_D_MODEL)
