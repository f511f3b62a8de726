"""`--image FILE.png` for Llama 3.2 Vision (mllama): our tiles, arrangement ids, tile masks and
cross-attention masks (runtime/image_preprocess.py, runtime/image_tiles.py) against transformers'
MllamaImageProcessorPil and MllamaProcessor, and the CLI's `--image` against `--images` with the
processor's output on the tiny mllama of tests/test_mllama_vision.py."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from test_image_preprocess import _png  # noqa: E402

from mxc.runtime import image_preprocess as ip  # noqa: E402
from mxc.runtime import image_tiles  # noqa: E402

# The released Llama 3.2 Vision processor's mean and std (OpenAI CLIP's), written here from
# transformers' constants so that a wrong table in image_preprocess.py fails.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# (height, width, mode): 2x2, 3x1, 1x2, 1x3 and 1x1 tiles at side 16; grayscale, RGBA, palette
IMAGES = [(50, 70, "RGB"), (90, 41, "RGB"), (13, 20, "RGB"), (25, 60, "P"), (16, 16, "RGB"), (33, 47, "L"),
          (40, 30, "RGBA")]
IMAGE_TOKEN = 127  # the tiny model's image token


def _tower(side: int):
    from mxc.spec.load import load_model

    return load_model("llama3.2-11b-vision").vision.model_copy(update={"image": side})


def _processor(side: int, max_tiles: int = 4):
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": side, "width": side}, max_image_tiles=max_tiles,
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD, resample=2,
                                   rescale_factor=0.00392156862745098)


@pytest.mark.parametrize("height,width,mode", IMAGES)
def test_tiles_ids_and_masks_equal_the_processors(tmp_path, height, width, mode):
    from PIL import Image

    path = _png(tmp_path, height, width, mode)
    with Image.open(path) as image:
        reference = _processor(16)(images=[[image]], return_tensors="np")
    ours = ip.pixel_values(_tower(16), path)
    tiles = len(ours.pixels)
    assert ours.pixels.dtype == np.float32 and tiles == ours.tile_rows * ours.tile_cols
    np.testing.assert_array_equal(ours.pixels, reference["pixel_values"][0, 0, :tiles])
    assert not reference["pixel_values"][0, 0, tiles:].any()  # the processor's padding tiles are zeros
    assert image_tiles.aspect_ratio_id(ours.tile_rows, ours.tile_cols, 4) == reference["aspect_ratio_ids"][0, 0]
    np.testing.assert_array_equal(image_tiles.aspect_ratio_mask([[tiles]], 4), reference["aspect_ratio_mask"])


def test_a_wide_image_at_the_released_side(tmp_path):
    """560-pixel tiles: a 600x1500 image takes 1x3 tiles (id 3), downscaled into them."""
    from PIL import Image

    path = _png(tmp_path, 600, 1500, "RGB")
    with Image.open(path) as image:
        reference = _processor(560)(images=[[image]], return_tensors="np")
    ours = ip.pixel_values(_tower(560), path)
    assert (ours.tile_rows, ours.tile_cols) == (1, 3) and reference["aspect_ratio_ids"][0, 0] == 3
    np.testing.assert_array_equal(ours.pixels, reference["pixel_values"][0, 0, :3])


def test_arrangements_and_canvas_choice_follow_the_processor():
    from transformers.models.mllama import image_processing_pil_mllama as hf

    for max_tiles in (1, 4, 6):
        assert image_tiles.tile_arrangements(max_tiles) == hf.get_all_supported_aspect_ratios(max_tiles)
    rng = np.random.default_rng(0)
    for height, width in rng.integers(1, 2000, (300, 2)).tolist() + [[560, 560], [1120, 560], [1, 5000]]:
        rows, cols = image_tiles.best_tiling(height, width, 4, 560)
        assert (rows * 560, cols * 560) == tuple(int(n) for n in hf.get_optimal_tiled_canvas(height, width, 4, 560))
        assert image_tiles.fitted_size(height, width, rows, cols, 560) == \
            hf.get_image_size_fit_to_canvas(height, width, rows * 560, cols * 560, 560)


def test_cross_attention_mask_is_the_processors():
    from transformers.models.mllama.processing_mllama import (build_string_from_input,
                                                              convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    I = IMAGE_TOKEN  # noqa: E741
    rows = [[5, I, 6, 7, I, 8, 9], [I, I, 3, 4, 5, 6, 7], [1, 2, 3, I, 4, I, I]]
    tiles = [[4, 2], [1, 3], [2, 4, 1]]
    ranges = [get_cross_attention_token_mask(row, I) for row in rows]
    for row, sparse in zip(rows, ranges):
        assert [list(r) for r in image_tiles.image_token_ranges(row, I)] == \
            [[start, len(row) if end == -1 else end] for start, end in sparse]
    reference = convert_sparse_cross_attention_mask_to_dense(ranges, tiles, 4, 7)
    np.testing.assert_array_equal(image_tiles.cross_attention_mask(np.array(rows), I, tiles, 4), reference)
    for prompt in ["hello <|image|>", "<|image|><|image|>hi", "<B>x <|image|>", "x"]:
        assert image_tiles.with_begin_after_leading_images(prompt, "<B>", "<|image|>") == \
            build_string_from_input(prompt, "<B>", "<|image|>")


def test_image_files_fill_each_rows_image_tokens_in_order(tmp_path):
    """Two prompt rows holding one and two image tokens take the three files in order, batched as
    MllamaProcessor batches nested images (padding images and tiles, their masks)."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    from mxc.compiler.commands.images import read_images

    I = IMAGE_TOKEN  # noqa: E741
    tokens = np.array([[5, I, 6, 7, 8], [I, I, 3, 4, 5]])
    files = [_png(tmp_path, 50, 70, "RGB"), _png(tmp_path, 90, 41, "RGB"), _png(tmp_path, 13, 20, "RGB")]
    spec = SimpleNamespace(name="tiny", vision=_tower(16).model_copy(update={"entry": _tower(16).entry.model_copy(
        update={"token": I})}))
    ours = read_images(None, spec, tokens, [ip.pixel_values(spec.vision, f) for f in files])
    images = [[Image.open(files[0])], [Image.open(f) for f in files[1:]]]
    reference = _processor(16)(images=images, return_tensors="np")
    np.testing.assert_array_equal(ours["pixel_values"], reference["pixel_values"])
    np.testing.assert_array_equal(ours["aspect_ratio_ids"], reference["aspect_ratio_ids"])
    np.testing.assert_array_equal(ours["aspect_ratio_mask"], reference["aspect_ratio_mask"])
    sparse = [get_cross_attention_token_mask(row, I) for row in tokens.tolist()]
    np.testing.assert_array_equal(ours["cross_attention_mask"], convert_sparse_cross_attention_mask_to_dense(
        sparse, reference["num_tiles"], 4, tokens.shape[1]))


# ---------------------------------------------------------------- the CLI on the tiny mllama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random mllama imported, with a word-level tokenizer (w0, w2..w126, <|image|> 127, and
    <|begin_of_text|> 1 as its begin token), and MllamaProcessor over the same tokenizer."""
    import json

    from test_mllama_vision import _hf_model
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import MllamaProcessor, PreTrainedTokenizerFast

    from mxc.compiler.hf.convert import import_hf

    root = tmp_path_factory.mktemp("mllama")
    _hf_model(seed=1).save_pretrained(root / "hf")
    import_hf(root / "hf", root / "mxc")
    vocab = {f"w{i}": i for i in range(IMAGE_TOKEN) if i != 1}
    vocab.update({"<|begin_of_text|>": 1, "<|image|>": IMAGE_TOKEN})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|begin_of_text|>", "<|image|>")])
    tokenizer.save(str(root / "mxc" / "tokenizer.json"))
    (root / "mxc" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>")
    processor = MllamaProcessor(_processor(16), fast)
    return root / "mxc", processor


def _processor_inputs(processor, prompt: str, files, path):
    from PIL import Image

    images = [Image.open(f) for f in files]
    out = processor(images=[images], text=[prompt], return_tensors="np")
    np.save(path / "t.npy", out["input_ids"].astype(np.int64))
    np.savez(path / "in.npz", **{k: out[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask",
                                                      "cross_attention_mask")})
    return out


def test_forward_image_equals_images_with_the_processors_output(tiny_dir, tmp_path, capsys):
    """Two images (2x2 and 3x1 tiles) before and inside the text: the logits of --image equal
    those of --images with MllamaProcessor's arrays, bit for bit; a missing image token is one error."""
    from mxc.compiler.cli import main

    model, processor = tiny_dir
    files = [_png(tmp_path, 50, 70, "RGB"), _png(tmp_path, 90, 41, "RGB", seed=1)]
    out = _processor_inputs(processor, "<|image|>w5 w6 <|image|> w7 w8", files, tmp_path)
    assert out["input_ids"].tolist() == [[IMAGE_TOKEN, 1, 5, 6, IMAGE_TOKEN, 7, 8]]
    base = ["forward", str(model), "--tokens", str(tmp_path / "t.npy")]
    assert main(base + ["--images", str(tmp_path / "in.npz"), "-o", str(tmp_path / "a.npy")]) == 0
    assert main(base + sum((["--image", str(f)] for f in files), []) + ["-o", str(tmp_path / "b.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    capsys.readouterr()
    assert main(base + ["--image", str(files[0]), "-o", str(tmp_path / "c.npy")]) != 0
    error = capsys.readouterr().err
    assert "1 image file(s) for 2 image token(s)" in error and "Traceback" not in error


@pytest.mark.slow  # about 30 s under load: two generate runs on the tiny mllama
def test_generate_prompt_with_image_equals_the_processors_tokens_and_arrays(tiny_dir, tmp_path, capsys):
    from mxc.compiler.cli import main

    model, processor = tiny_dir
    files = [_png(tmp_path, 13, 20, "RGB"), _png(tmp_path, 40, 30, "RGBA", seed=2)]
    prompt = "<|image|>w9 w3 <|image|> w4 w11"
    out = _processor_inputs(processor, prompt, files, tmp_path)
    images = sum((["--image", str(f)] for f in files), [])
    assert main(["generate", str(model), "--prompt", prompt, *images, "--max-new", "8",
                 "-o", str(tmp_path / "text.npy")]) == 0
    assert main(["generate", str(model), "--prompt-tokens", str(tmp_path / "t.npy"), "--images",
                 str(tmp_path / "in.npz"), "--max-new", "8", "-o", str(tmp_path / "ids.npy")]) == 0
    by_text, by_ids = np.load(tmp_path / "text.npy"), np.load(tmp_path / "ids.npy")
    np.testing.assert_array_equal(by_text[:, :out["input_ids"].shape[1]], out["input_ids"])
    np.testing.assert_array_equal(by_text, by_ids)
    capsys.readouterr()
    assert main(["generate", str(model), "--prompt", "w5 w6", "--image", str(files[0]), "--max-new", "1"]) != 0
    assert "0 image marker(s) '<|image|>' for 1 image(s)" in capsys.readouterr().err
