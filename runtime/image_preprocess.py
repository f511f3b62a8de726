"""Image files to a vision tower's `pixel_values`, as the model's HF processor makes them.

    preprocessing_for(tower) -> Preprocessing      the processor's constants, by tower family
    read_rgb(path) -> uint8 [height, width, 3]     any Pillow image, transparency over white
    pixel_values(tower, path) -> ImagePixels       float32 [tiles, 3, side, side] and the tile layout
    expand_image_markers(text, tower, images, token_text) -> text with each marker as the processor writes it

Written with Pillow and numpy from the processors' published steps (transformers 5.23's
Gemma3ImageProcessorPil and Llama4ImageProcessor); transformers is never imported here.

Gemma 3 (a SigLIP tower, `avg_pool` projector): convert to RGB, resize the whole image to the
tower's square side with Pillow's bilinear filter (no aspect ratio kept), rescale by 1/255 in
float64 then float32, normalise with mean = std = 0.5. Bit for bit the PIL processor's output.
Pan-and-scan crops (off in the released processor configs) are not made.

Llama 4 (`pixel_shuffle` projector): tiles of the tower's side. The image is resized without
distortion onto the best canvas of at most `max_tiles` tiles (the smallest upscale, else the least
downscale; never upscaled past one tile's side), padded with black to the canvas on the right and
bottom, rescaled and normalised in bfloat16 (as the processor does), and cut into tiles in
row-major order; with more than one tile a global tile (the whole image squashed to one tile)
follows. transformers resizes with torchvision's antialiased bilinear kernel on uint8, which
differs from Pillow's by one level in a few pixels (docs/multimodal.md has the measure).

Llama 3.2 Vision (`linear` projector, a tiled tower): MllamaImageProcessorPil's steps. The canvas of
at most the tower's `tiles.max` tiles (runtime/image_tiles.py chooses it, in float64 and its own
order), the image resized into it keeping its aspect ratio (never upscaled past one tile) with
Pillow's bilinear filter, black padding right and bottom, rescaled and normalised as Gemma 3's
(float64 then float32) but with OpenAI CLIP's mean and std, cut into tiles row by row; no global
tile. The tower's inputs beside the pixels (arrangement ids, tile and cross-attention masks) are
image_tiles.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mxc.spec.ir import PixelShuffleProjector, PooledProjector, VisionTower


class ImageInputError(ValueError):
    """An image file that cannot be read, or a tower whose processor is not written here."""


@dataclass(frozen=True)
class Preprocessing:
    """One processor's constants (the released preprocessor_config.json values)."""

    family: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255  # the configs' 0.00392156862745098
    max_tiles: int = 1  # Llama 4's max_patches: tiles per image, the global tile aside (mllama: the tower's)
    bfloat16: bool = False  # Llama 4 rescales and normalises in bfloat16


# Keyed by the projector kind, which names the tower family in the IR.
PREPROCESSING = {
    "avg_pool": Preprocessing("gemma3", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
    "pixel_shuffle": Preprocessing("llama4", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), max_tiles=16,
                                   bfloat16=True),
    # meta-llama/Llama-3.2-11B-Vision(-Instruct)'s preprocessor_config.json: OpenAI CLIP's mean and
    # std (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), bilinear, 1/255; the processor class's
    # own defaults (0.5) are overridden there. Its max_image_tiles (4) is the tower's tiles.max.
    "linear": Preprocessing("mllama", mean=(0.48145466, 0.4578275, 0.40821073),
                            std=(0.26862954, 0.26130258, 0.27577711)),
}


def preprocessing_for(tower: VisionTower) -> Preprocessing:
    kind = tower.projector.kind
    if kind not in PREPROCESSING:
        raise ImageInputError(f"--image: no preprocessing is written for a tower with a {kind} projector "
                              f"(preprocess with the model's HF processor and pass --images INPUTS.npz)")
    return PREPROCESSING[kind]


def read_rgb(path) -> np.ndarray:
    """uint8 [height, width, 3]; transparency composited over white, as transformers' convert_to_rgb."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                rgb = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                rgb = image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise ImageInputError(f"--image: cannot read {path}: {err}") from None
    return np.asarray(rgb, dtype=np.uint8)


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(rgb).resize((width, height), resample=Image.BILINEAR), dtype=np.uint8)


def _normalise(rgb: np.ndarray, prep: Preprocessing) -> np.ndarray:
    """uint8 [h, w, 3] -> float32 [3, h, w]."""
    mean, std = np.asarray(prep.mean, np.float32), np.asarray(prep.std, np.float32)
    if prep.bfloat16:
        # Llama4ImageProcessor: uint8 -> bfloat16, times the factor, minus mean, over std, each step
        # rounded to bfloat16 (computed in float32, as torch does on CPU).
        from ml_dtypes import bfloat16

        x = (rgb.astype(np.float32) * np.float32(prep.rescale)).astype(bfloat16)
        x = (x.astype(np.float32) - mean).astype(bfloat16)
        x = (x.astype(np.float32) / std).astype(bfloat16).astype(np.float32)
    else:
        # The PIL processor: rescale in float64, cast to float32, then normalise in float32.
        x = (rgb.astype(np.float64) * prep.rescale).astype(np.float32)
        x = (x - mean) / std
    return np.ascontiguousarray(np.moveaxis(x, -1, 0))


@dataclass(frozen=True)
class ImagePixels:
    pixels: np.ndarray  # float32 [tiles, 3, side, side]: one entry of pixel_values per tile
    tile_rows: int = 1  # the canvas, in tiles (Llama 4: a global tile follows when rows * cols > 1)
    tile_cols: int = 1


def supported_canvases(max_tiles: int, side: int) -> list[tuple[int, int]]:
    """Every (height, width) canvas of at most max_tiles tiles, in Llama4ImageProcessor's order
    (it decides ties of equal scale by area, then by this order)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for tiles in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, tiles + 1) if tiles % d == 0):
            by_ratio.setdefault(rows / (tiles // rows), []).append((rows, tiles // rows))
    return [(rows * side, cols * side) for group in by_ratio.values() for rows, cols in group]


def best_canvas(height: int, width: int, max_tiles: int, side: int) -> tuple[int, int]:
    """The smallest upscale that fits a canvas, else the least downscale; the smallest area on ties."""
    canvases = supported_canvases(max_tiles, side)
    # float32, as the processor divides torch integer tensors
    scales = [min(np.float32(h) / np.float32(height), np.float32(w) / np.float32(width)) for h, w in canvases]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    fits = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(fits, key=lambda c: c[0] * c[1])  # min keeps the first of equal areas, as argmin does


def _size_without_distortion(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return max(min(math.floor(height * scale_w), target_h), 1), max(target_w, 1)
    return max(target_h, 1), max(min(math.floor(width * scale_h), target_w), 1)


def _llama4_tiles(rgb: np.ndarray, side: int, prep: Preprocessing) -> ImagePixels:
    height, width = rgb.shape[:2]
    canvas_h, canvas_w = best_canvas(height, width, prep.max_tiles, side)
    # Upscaling stops at one tile's side (the processor's resize_to_max_canvas = False).
    target_h, target_w = min(max(height, side), canvas_h), min(max(width, side), canvas_w)
    new_h, new_w = _size_without_distortion(height, width, target_h, target_w)
    canvas = np.zeros((canvas_h, canvas_w, 3), np.uint8)  # black padding, right and bottom
    canvas[:new_h, :new_w] = _resize(rgb, new_h, new_w)
    rows, cols = canvas_h // side, canvas_w // side
    tiles = _split_tiles(_normalise(canvas, prep), rows, cols, side)
    if rows * cols > 1:
        tiles = np.concatenate([tiles, _normalise(_resize(rgb, side, side), prep)[None]])
    return ImagePixels(np.ascontiguousarray(tiles), rows, cols)


def _split_tiles(pixels: np.ndarray, rows: int, cols: int, side: int) -> np.ndarray:
    """float32 [3, rows * side, cols * side] -> [rows * cols, 3, side, side], row by row."""
    return pixels.reshape(3, rows, side, cols, side).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, side, side)


def _mllama_tiles(rgb: np.ndarray, side: int, max_tiles: int, prep: Preprocessing) -> ImagePixels:
    from mxc.runtime.image_tiles import best_tiling, fitted_size

    height, width = rgb.shape[:2]
    rows, cols = best_tiling(height, width, max_tiles, side)
    new_h, new_w = fitted_size(height, width, rows, cols, side)
    canvas = np.zeros((rows * side, cols * side, 3), np.uint8)  # black padding, normalised with the image
    canvas[:new_h, :new_w] = _resize(rgb, new_h, new_w)
    return ImagePixels(np.ascontiguousarray(_split_tiles(_normalise(canvas, prep), rows, cols, side)), rows, cols)


def image_pixels(tower: VisionTower, rgb: np.ndarray) -> ImagePixels:
    """uint8 [h, w, 3] -> the tower's pixel_values for this image."""
    prep = preprocessing_for(tower)
    if tower.patches.channels != 3:
        raise ImageInputError(f"--image: the tower takes {tower.patches.channels} channels; image files give 3")
    if prep.family == "llama4":
        return _llama4_tiles(rgb, tower.image, prep)
    if prep.family == "mllama":
        return _mllama_tiles(rgb, tower.image, tower.tiles.max, prep)
    return ImagePixels(_normalise(_resize(rgb, tower.image, tower.image), prep)[None])


def pixel_values(tower: VisionTower, path) -> ImagePixels:
    return image_pixels(tower, read_rgb(path))


def padded_tiles(image: ImagePixels, max_tiles: int) -> np.ndarray:
    """A tiled tower's image as MllamaProcessor packs it: [max_tiles, 3, side, side], zeros past its tiles."""
    pixels = np.zeros((max_tiles, *image.pixels.shape[1:]), np.float32)
    pixels[:len(image.pixels)] = image.pixels
    return pixels


def placeholder_count(tower: VisionTower, image: ImagePixels) -> int:
    """Placeholder tokens the image's soft tokens fill: every tile's, the global tile's included."""
    from mxc.compiler.kinds.vision import tokens_per_image

    return len(image.pixels) * tokens_per_image(tower)


def image_marker(tower: VisionTower, token_text) -> str:
    """The text a prompt holds where an image goes: the processor's marker (Gemma 3:
    `<start_of_image>`, the begin token; Llama 4: `<|image|>`; Llama 3.2 Vision: its image token's
    text, `<|image|>` in its tokenizer)."""
    prep = preprocessing_for(tower)
    if prep.family == "llama4":
        return "<|image|>"
    if prep.family == "mllama":
        return token_text(tower.entry.token)
    return token_text(tower.entry.begin)


def expanded_image_text(tower: VisionTower, image: ImagePixels, token_text) -> str:
    """What the processor writes in place of one marker. token_text(id) gives a token's text."""
    from mxc.compiler.kinds.vision import tokens_per_image

    if preprocessing_for(tower).family == "mllama":  # one image token each, the cross layers' to see
        return token_text(tower.entry.token)
    per_tile = token_text(tower.entry.token) * tokens_per_image(tower)
    begin, end = token_text(tower.entry.begin), token_text(tower.entry.end)
    if preprocessing_for(tower).family == "gemma3":  # Gemma3Processor's full_image_sequence
        return f"\n\n{begin}{per_tile}{end}\n\n"
    text = begin  # Llama4Processor._prompt_split_image
    if image.tile_rows * image.tile_cols > 1:
        for _ in range(image.tile_rows):
            text += "<|tile_x_separator|>".join([per_tile] * image.tile_cols) + "<|tile_y_separator|>"
    return text + "<|image|>" + per_tile + end


def expand_image_markers(text: str, tower: VisionTower, images: list[ImagePixels], token_text) -> str:
    """Each marker in text, in order, replaced by its image's expansion; their number must match."""
    marker = image_marker(tower, token_text)
    parts = text.split(marker)
    if len(parts) - 1 != len(images):
        raise ImageInputError(f"--image: the prompt has {len(parts) - 1} image marker(s) {marker!r} for "
                              f"{len(images)} image(s); write {marker} where each image goes, in order")
    out = parts[0]
    for image, rest in zip(images, parts[1:]):
        out += expanded_image_text(tower, image, token_text) + rest
    return out
