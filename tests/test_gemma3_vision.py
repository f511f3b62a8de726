"""Gemma 3 with images: the vision tower in the language, its counts, and (below) parity with
transformers' Gemma3ForConditionalGeneration on tiny random models."""

import json
from pathlib import Path

import pytest

from mxc.compiler.analysis import summarize
from mxc.spec import load_text
from mxc.spec.format import format_text
from mxc.spec.load import load_model

from located_errors import assert_refused_where_written  # noqa: E402

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
    assert_refused_where_written(TOWER % f"  {line}", line, needle, message)


# ---------------------------------------------------------------- parity with transformers

BEGIN, END, IMAGE = 297, 298, 299  # the tiny model's begin-of-image, end-of-image and placeholder ids


def _tiny_hf_model():
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                sliding_window=6, query_pre_attn_scalar=16, rope_theta=10000.0,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    # A 28-pixel image in 7-pixel patches: a 4x4 grid pooled to 2x2 = 4 soft tokens.
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=7, num_channels=3, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=IMAGE, boi_token_index=BEGIN, eoi_token_index=END)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # away from the initial zeros and ones, so every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the HF model, its checkpoint directory, the imported spec and parameters)."""
    from mxc.compiler.hf.convert import import_hf
    from mxc.compiler.hf.model_dir import load_spec_and_params

    root = tmp_path_factory.mktemp("gemma3_vision")
    model = _tiny_hf_model()
    model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "mxc")
    spec, params = load_spec_and_params(str(root / "mxc"))
    return model, root, spec, params


def _prompt(images: int):
    import numpy as np

    ids = [2, 5]
    for i in range(images):
        ids += [BEGIN] + [IMAGE] * 4 + [END] + [7 + i, 8]
    tokens = np.array([ids + [9, 10, 11]], np.int64)
    rng = np.random.default_rng(images)
    return tokens, (tokens == IMAGE).astype(np.int64), rng.standard_normal((images, 3, 28, 28)).astype(np.float32)


@pytest.mark.parametrize("images", [1, 2])
def test_logits_equal_transformers_with_images(imported, images):
    import numpy as np
    import torch

    from mxc.compiler.lower.model import forward

    model, _, spec, params = imported
    tokens, types, pixels = _prompt(images)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                    token_type_ids=torch.tensor(types)).logits.numpy()
    ours = np.asarray(forward(spec, params, tokens.astype(np.int32), dtype="float32", pixel_values=pixels,
                              token_type_ids=types.astype(np.int32))[0])
    assert np.abs(ours - ref).max() < 1e-4


def test_greedy_decode_equals_transformers_with_two_images(imported, tmp_path):
    import numpy as np
    import torch
    from transformers import GenerationConfig

    from mxc.compiler.commands.generate import spec_servable
    from mxc.runtime.generate import generate

    model, _, spec, params = imported
    tokens, types, pixels = _prompt(2)
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                             token_type_ids=torch.tensor(types),
                             generation_config=GenerationConfig(do_sample=False, max_new_tokens=8,
                                                                pad_token_id=0, eos_token_id=None)).numpy()
    width = tokens.shape[1]
    servable = spec_servable(spec, 1, width, width + 7, "float32",
                             images={"pixel_values": pixels, "token_type_ids": types.astype(np.int32)})
    ours, _ = generate(servable, params, tokens.astype(np.int32), 8)
    assert ours[0, -8:].tolist() == ref[0, -8:].tolist()


@pytest.mark.parametrize("spelling", ["saved", "hub", "module"])
def test_every_spelling_of_the_checkpoint_imports_and_exports_bit_for_bit(imported, tmp_path, spelling):
    """transformers' save_pretrained (language_model.model.*, vision_tower.*), the hub's files
    (vision_tower.vision_model.*) and the module tree's names (model.language_model.*)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from mxc.compiler.hf.convert import export_hf, import_hf
    from mxc.compiler.hf.model_dir import load_spec_and_params

    _, root, spec, params = imported
    source = tmp_path / "hf"
    shutil.copytree(root / "hf", source)
    tensors = load_file(source / "model.safetensors")
    rename = {"saved": lambda n: n,
              "hub": lambda n: n.replace("vision_tower.", "vision_tower.vision_model.", 1),
              "module": lambda n: "model." + n.replace("language_model.model.", "language_model.", 1)}[spelling]
    save_file({rename(n): t for n, t in tensors.items()}, source / "model.safetensors", metadata={"format": "pt"})
    import_hf(source, tmp_path / "mxc")
    spec_again, params_again = load_spec_and_params(str(tmp_path / "mxc"))
    assert spec_again.model_copy(update={"name": spec.name}) == spec
    export_hf(spec_again, params_again, tmp_path / "back", tmp_path / "mxc")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_forward_cli_takes_the_processor_inputs(imported, tmp_path):
    import subprocess
    import sys

    import numpy as np

    _, root, spec, params = imported
    tokens, types, pixels = _prompt(1)
    np.save(tmp_path / "t.npy", tokens)
    np.savez(tmp_path / "in.npz", pixel_values=pixels[:, :, :27], token_type_ids=types)
    cli = [sys.executable, "-m", "mxc.compiler.cli", "forward", str(root / "mxc"), "--tokens", str(tmp_path / "t.npy"),
           "--images", str(tmp_path / "in.npz"), "-o", str(tmp_path / "l.npy")]
    bad = subprocess.run(cli, capture_output=True, text=True)
    assert bad.returncode != 0 and "pixel_values must be [images, 3, 28, 28]" in bad.stderr
    assert "Traceback" not in bad.stderr
