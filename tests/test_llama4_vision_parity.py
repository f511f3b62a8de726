"""The whole tiny Llama 4 with images against transformers' Llama4ForConditionalGeneration:
import and export, float32 logits, greedy decoding, and `mxc forward --images` (about 2 minutes
on the loaded machine: slow tests)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_llama4_vision import _hf_model, _tiny_spec  # noqa: E402

pytestmark = pytest.mark.slow

BEGIN, END, IMAGE = 98, 99, 100  # the tiny model's begin-of-image, end-of-image and placeholder ids


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the HF model, its checkpoint directory, the imported spec and parameters)."""
    from mxc.compiler.hf.convert import import_hf
    from mxc.compiler.hf.model_dir import load_spec_and_params

    root = tmp_path_factory.mktemp("llama4_vision")
    model = _hf_model()
    model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "mxc")
    spec, params = load_spec_and_params(str(root / "mxc"))
    return model, root, spec, params


def _prompt(images: int):
    """Text around each image's begin token, 16 placeholders and end token, as the processor lays
    out an image of one tile; 22 tokens for one image, 42 for two (past the 16-token chunks)."""
    ids = [2, 5]
    for i in range(images):
        ids += [BEGIN] + [IMAGE] * 16 + [END] + [7 + i, 8]
    tokens = np.array([ids + [9, 10, 11]], np.int64)
    pixels = np.random.default_rng(images).standard_normal((images, 3, 32, 32)).astype(np.float32)
    return tokens, pixels


def test_import_reads_the_tower_and_export_writes_the_checkpoint_back_bit_for_bit(imported, tmp_path):
    from mxc.compiler.hf.convert import export_hf

    model, root, spec, params = imported
    assert spec.vision == _tiny_spec().vision
    export_hf(spec, params, tmp_path / "back", root / "mxc")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (root / "hf" / "model.safetensors").read_bytes()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert type(config).__name__ == "Llama4Config" and config.vision_config.pixel_shuffle_ratio == 0.5


@pytest.mark.parametrize("images", [1, 2])
def test_logits_equal_transformers_with_images(imported, images):
    from mxc.compiler.lower.model import forward

    model, _, spec, params = imported
    tokens, pixels = _prompt(images)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels)).logits.numpy()
    ours = np.asarray(forward(spec, params, tokens.astype(np.int32), dtype="float32", pixel_values=pixels)[0])
    assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize("images", [1, 2])
def test_greedy_decode_equals_transformers_with_images(imported, images):
    from transformers import GenerationConfig

    from mxc.compiler.commands.generate import spec_servable
    from mxc.runtime.generate import generate

    model, _, spec, params = imported
    tokens, pixels = _prompt(images)
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                             generation_config=GenerationConfig(do_sample=False, max_new_tokens=8,
                                                                pad_token_id=0, eos_token_id=None)).numpy()
    width = tokens.shape[1]
    servable = spec_servable(spec, 1, width, width + 7, "float32", images={"pixel_values": pixels})
    ours, _ = generate(servable, params, tokens.astype(np.int32), 8)
    assert ours[0, -8:].tolist() == ref[0, -8:].tolist()


def test_forward_cli_counts_the_placeholders_per_image(imported, tmp_path):
    import subprocess
    import sys

    _, root, _, _ = imported
    tokens, pixels = _prompt(1)
    np.save(tmp_path / "t.npy", np.delete(tokens, [3, 4], axis=1))  # 14 of the 16 placeholders
    np.savez(tmp_path / "in.npz", pixel_values=pixels)
    cli = [sys.executable, "-m", "mxc.compiler.cli", "forward", str(root / "mxc"), "--tokens", str(tmp_path / "t.npy"),
           "--images", str(tmp_path / "in.npz"), "-o", str(tmp_path / "l.npy")]
    bad = subprocess.run(cli, capture_output=True, text=True)
    assert bad.returncode != 0 and "1 image(s) of 16 tokens need 16 placeholder tokens" in bad.stderr
    assert "Traceback" not in bad.stderr
