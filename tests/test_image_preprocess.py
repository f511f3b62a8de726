"""`--image FILE.png`: image files preprocessed as the models' HF processors do (runtime/image_preprocess.py),
against transformers' processors on synthetic PNGs the tests write, and the CLI's `--image` against
`--images` with the processor's pixel_values."""

import numpy as np
import pytest

from mxc.runtime import image_preprocess as ip

# (height, width, Pillow mode): landscape, portrait, upscaled, a grayscale, an RGBA and a palette image
IMAGES = [(50, 70, "RGB"), (90, 41, "RGB"), (13, 20, "RGB"), (33, 47, "L"), (40, 30, "RGBA"), (25, 60, "P")]


def _png(tmp_path, height, width, mode, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed + height * width)
    channels = {"RGB": 3, "L": 1, "RGBA": 4, "P": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    # smooth gradients as well as noise, so the filter's weights matter everywhere
    array = (array // 2 + (np.arange(width)[None, :, None] * 255 // width) // 2).astype(np.uint8)
    image = Image.fromarray(array[..., 0] if channels == 1 else array, mode="L" if mode == "P" else mode)
    if mode == "P":
        image = image.convert("P")
    path = tmp_path / f"{height}x{width}{mode}.png"
    image.save(path)
    return path


def _tower(projector: str, image: int):
    from mxc.spec.load import load_model

    spec = load_model({"avg_pool": "gemma3-4b", "pixel_shuffle": "llama4-17b-16e"}[projector])
    return spec.vision.model_copy(update={"image": image})


@pytest.mark.parametrize("height,width,mode", IMAGES)
def test_gemma3_pixels_equal_the_processors_bit_for_bit(tmp_path, height, width, mode):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = _png(tmp_path, height, width, mode)
    # the released processor config's values (google/gemma-3-*-it preprocessor_config.json), at a small side
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, resample=2, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3, rescale_factor=0.00392156862745098)
    with Image.open(path) as image:
        reference = processor(images=image, return_tensors="np")["pixel_values"]
    ours = ip.pixel_values(_tower("avg_pool", 28), path).pixels
    assert ours.dtype == np.float32 and ours.shape == reference.shape == (1, 3, 28, 28)
    np.testing.assert_array_equal(ours, reference)


def _torch_llama4(rgb: np.ndarray, side: int, max_tiles: int):
    """Llama4ImageProcessor._preprocess's steps in torch (transformers 5.23), with torchvision's
    uint8 antialiased bilinear resize as torch's own interpolate (torchvision is not installed here)."""
    import torch

    def resize(x, h, w):
        return torch.nn.functional.interpolate(x[None], size=(h, w), mode="bilinear", antialias=True)[0]

    def rescale_normalize(x):
        x = x.to(torch.bfloat16) * 0.00392156862745098
        mean = torch.as_tensor([0.5] * 3, dtype=torch.bfloat16)[:, None, None]
        return (x - mean) / mean

    image = torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()
    height, width = image.shape[-2:]
    canvases = torch.tensor(ip.supported_canvases(max_tiles, side))
    scale = torch.minimum(canvases[:, 0] / height, canvases[:, 1] / width)
    up = scale[scale >= 1]
    chosen = up.min() if len(up) else scale[scale < 1].max()
    fits = canvases[scale == chosen]
    canvas = fits[torch.argmin(fits[:, 0] * fits[:, 1])].tolist()
    target = (min(max(height, side), canvas[0]), min(max(width, side), canvas[1]))
    sw, sh = target[1] / width, target[0] / height
    new = (min(int(height * sw), target[0]), target[1]) if sw < sh else (target[0], min(int(width * sh), target[1]))
    resized = resize(image, max(new[0], 1), max(new[1], 1))
    padded = torch.nn.functional.pad(resized, (0, canvas[1] - resized.shape[2], 0, canvas[0] - resized.shape[1]))
    pixels = rescale_normalize(padded)
    rows, cols = canvas[0] // side, canvas[1] // side
    tiles = pixels.reshape(3, rows, side, cols, side).permute(1, 3, 0, 2, 4).reshape(-1, 3, side, side)
    if rows * cols > 1:
        tiles = torch.cat([tiles, rescale_normalize(resize(image, side, side))[None]])
    return tiles.float().numpy(), (rows, cols), padded.permute(1, 2, 0).numpy()


@pytest.mark.parametrize("height,width,mode", IMAGES)
@pytest.mark.parametrize("max_tiles", [1, 16])
def test_llama4_tiles_follow_the_processor(tmp_path, height, width, mode, max_tiles):
    """The canvas, padding, tiling, global tile and bfloat16 arithmetic equal the processor's; the
    resize is Pillow's, which torchvision's uint8 kernel matches within one level."""
    side = 16
    path = _png(tmp_path, height, width, mode)
    prep = ip.Preprocessing("llama4", (0.5,) * 3, (0.5,) * 3, max_tiles=max_tiles, bfloat16=True)
    rgb = ip.read_rgb(path)
    ours = ip._llama4_tiles(rgb, side, prep)
    reference, (rows, cols), torch_canvas = _torch_llama4(rgb, side, max_tiles)
    assert (ours.tile_rows, ours.tile_cols) == (rows, cols)
    assert ours.pixels.shape == reference.shape
    assert max_tiles > 1 or len(ours.pixels) == 1
    # one uint8 level is 2/255 after normalising; bfloat16 rounds that to at most 1/64 more
    assert np.abs(ours.pixels - reference).max() <= 2 / 255 + 1 / 64
    # given torch's resized canvas, the rest is bit for bit (the global tile aside: resized again)
    exact = ip._normalise(torch_canvas, prep)
    tiles = exact.reshape(3, rows, side, cols, side).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, side, side)
    np.testing.assert_array_equal(tiles, reference[:rows * cols])


def test_llama4_canvas_choice_matches_the_processors_examples():
    # Llama4ImageProcessor's docstring: a 200x300 image among these canvases fits 224x448
    assert ip.best_canvas(200, 300, 3, 224) == (224, 448)
    assert ip.supported_canvases(4, 224)[:3] == [(224, 896), (448, 448), (224, 224)]


def test_markers_expand_as_the_processors_write_them():
    gemma = _tower("avg_pool", 896)
    text = {gemma.entry.begin: "<start_of_image>", gemma.entry.token: "<image_soft_token>",
            gemma.entry.end: "<end_of_image>"}.get
    one = ip.ImagePixels(np.zeros((1, 3, 896, 896), np.float32))
    expanded = ip.expand_image_markers("Describe <start_of_image> now", gemma, [one], text)
    assert expanded == ("Describe \n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n now")
    with pytest.raises(ip.ImageInputError, match="1 image marker"):
        ip.expand_image_markers("<start_of_image>", gemma, [one, one], text)

    llama = _tower("pixel_shuffle", 336)
    text = {llama.entry.begin: "<|image_start|>", llama.entry.token: "<|patch|>", llama.entry.end: "<|image_end|>"}.get
    tiled = ip.ImagePixels(np.zeros((3, 3, 336, 336), np.float32), tile_rows=1, tile_cols=2)
    patches = "<|patch|>" * 144
    assert ip.expand_image_markers("<|image|>hi", llama, [tiled], text) == (
        "<|image_start|>" + patches + "<|tile_x_separator|>" + patches + "<|tile_y_separator|>"
        + "<|image|>" + patches + "<|image_end|>hi")


def test_unreadable_files_and_unwritten_towers_are_one_error(tmp_path):
    (tmp_path / "x.png").write_bytes(b"not a png")
    with pytest.raises(ip.ImageInputError, match="cannot read"):
        ip.read_rgb(tmp_path / "x.png")
    from types import SimpleNamespace

    # every projector kind of the IR has its processor written; a tower of another kind is refused
    other = _tower("avg_pool", 28).model_copy(update={"projector": SimpleNamespace(kind="other")})
    with pytest.raises(ip.ImageInputError, match="no preprocessing is written"):
        ip.preprocessing_for(other)


# ---------------------------------------------------------------- the CLI on the tiny Gemma 3


def test_forward_image_gives_the_logits_of_images_with_the_processors_npz(tmp_path, capsys):
    from PIL import Image
    from test_gemma3_vision import BEGIN, END, IMAGE, _tiny_hf_model
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from mxc.compiler.cli import main
    from mxc.compiler.hf.convert import import_hf

    _tiny_hf_model().save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mxc")
    files = [_png(tmp_path, 50, 70, "RGB"), _png(tmp_path, 40, 30, "RGBA", seed=1)]
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    images = [Image.open(f) for f in files]
    np.savez(tmp_path / "in.npz", pixel_values=processor(images=images, return_tensors="np")["pixel_values"])
    ids = [2, 5]
    for i in range(len(files)):
        ids += [BEGIN] + [IMAGE] * 4 + [END] + [7 + i]
    np.save(tmp_path / "t.npy", np.array([ids + [9, 10]], np.int64))
    base = ["forward", str(tmp_path / "mxc"), "--tokens", str(tmp_path / "t.npy")]
    assert main(base + ["--images", str(tmp_path / "in.npz"), "-o", str(tmp_path / "a.npy")]) == 0
    assert main(base + sum((["--image", str(f)] for f in files), []) + ["-o", str(tmp_path / "b.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    capsys.readouterr()
    assert main(base + ["--image", str(tmp_path / "t.npy"), "-o", str(tmp_path / "c.npy")]) != 0
    error = capsys.readouterr().err
    assert "cannot read" in error and "Traceback" not in error


@pytest.mark.slow  # about 20 s under load: two generate runs
def test_generate_expands_the_prompts_image_marker_as_the_processor(tmp_path, capsys):
    """A text prompt with Gemma 3's marker decodes as the same ids laid out by hand with --images."""
    from PIL import Image
    from test_gemma3_vision import BEGIN, END, IMAGE, _tiny_hf_model
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from mxc.compiler.cli import main
    from mxc.compiler.hf.convert import import_hf

    _tiny_hf_model().save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mxc")
    # a word-level tokenizer over the tiny vocabulary: w0..w296 and the three image tokens
    vocab = {f"w{i}": i for i in range(BEGIN)}
    vocab.update({"<start_of_image>": BEGIN, "<end_of_image>": END, "<image_soft_token>": IMAGE})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<start_of_image>", "<end_of_image>",
                                                                        "<image_soft_token>")])
    tokenizer.save(str(tmp_path / "mxc" / "tokenizer.json"))
    png = _png(tmp_path, 50, 70, "RGB")
    model = str(tmp_path / "mxc")
    assert main(["generate", model, "--prompt", "w5 w6 <start_of_image> w7", "--image", str(png),
                 "--max-new", "3", "-o", str(tmp_path / "text.npy")]) == 0
    prompt = np.array([[5, 6, BEGIN] + [IMAGE] * 4 + [END, 7]], np.int64)
    np.save(tmp_path / "p.npy", prompt)
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    np.savez(tmp_path / "in.npz", pixel_values=processor(images=[Image.open(png)], return_tensors="np")["pixel_values"])
    assert main(["generate", model, "--prompt-tokens", str(tmp_path / "p.npy"), "--images", str(tmp_path / "in.npz"),
                 "--max-new", "3", "-o", str(tmp_path / "ids.npy")]) == 0
    by_text, by_ids = np.load(tmp_path / "text.npy"), np.load(tmp_path / "ids.npy")
    np.testing.assert_array_equal(by_text[:, :prompt.shape[1]], prompt)
    np.testing.assert_array_equal(by_text, by_ids)
    capsys.readouterr()
    assert main(["generate", model, "--prompt", "w5 w6", "--image", str(png), "--max-new", "1"]) != 0
    assert "0 image marker(s) '<start_of_image>' for 1 image(s)" in capsys.readouterr().err


@pytest.mark.slow  # about 20 s under load
def test_llama4_tiles_fill_the_placeholders_the_processor_lays_out(tmp_path, capsys):
    """A 50x70 image on the tiny Llama 4 (32-pixel tiles) makes 2x3 tiles and a global tile; with the
    processor's layout in the ids, --image runs as --images with those pixels, and too few
    placeholders is one error counting tiles."""
    import re

    from test_llama4_vision import _hf_model

    from mxc.compiler.cli import main
    from mxc.compiler.hf.convert import import_hf
    from mxc.compiler.hf.model_dir import load_spec_and_params

    _hf_model().save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mxc")
    spec, _ = load_spec_and_params(str(tmp_path / "mxc"))
    png = _png(tmp_path, 50, 70, "RGB")
    image = ip.pixel_values(spec.vision, png)
    assert (image.tile_rows, image.tile_cols, len(image.pixels)) == (2, 3, 7)
    entry = spec.vision.entry
    text = ip.expanded_image_text(spec.vision, image, {entry.begin: "<B>", entry.end: "<E>", entry.token: "<P>"}.get)
    ids_of = {"<B>": entry.begin, "<E>": entry.end, "<P>": entry.token, "<|tile_x_separator|>": 5,
              "<|tile_y_separator|>": 6, "<|image|>": 7}
    ids = [2, 3] + [ids_of[t] for t in re.findall(r"<[^>]*>", text)] + [9]
    np.save(tmp_path / "t.npy", np.array([ids]))
    np.savez(tmp_path / "in.npz", pixel_values=image.pixels)
    base = ["forward", str(tmp_path / "mxc"), "--tokens", str(tmp_path / "t.npy")]
    assert main(base + ["--image", str(png), "-o", str(tmp_path / "a.npy")]) == 0
    assert main(base + ["--images", str(tmp_path / "in.npz"), "-o", str(tmp_path / "b.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    np.save(tmp_path / "short.npy", np.array([ids[:-20]]))
    capsys.readouterr()
    assert main(["forward", str(tmp_path / "mxc"), "--tokens", str(tmp_path / "short.npy"), "--image", str(png),
                 "-o", str(tmp_path / "c.npy")]) != 0
    assert "--image: 1 image file(s) in 7 tile(s) of 16 tokens need 112" in capsys.readouterr().err
