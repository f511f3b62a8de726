"""Llama 3.2 Vision's (mllama's) tiled image inputs beside the pixels: which canvas of tiles an image
gets, its arrangement's id, the tile mask, and the cross-attention mask from where the image tokens
stand in the prompt.

    tile_arrangements(max_tiles) -> [(rows, cols), ...]      in the processor's order; id = index + 1
    best_tiling(height, width, max_tiles, side) -> (rows, cols)
    fitted_size(height, width, rows, cols, side) -> (new_height, new_width)
    aspect_ratio_mask(tiles_per_image, max_tiles) -> int32 [batch, images, max_tiles]
    cross_attention_mask(tokens, image_token, tiles_per_image, max_tiles) -> int32 [batch, seq, images, max_tiles]

Written from transformers 5.23's MllamaImageProcessorPil (get_all_supported_aspect_ratios,
get_optimal_tiled_canvas, get_image_size_fit_to_canvas, build_aspect_ratio_mask_np) and
MllamaProcessor (get_cross_attention_token_mask, convert_sparse_cross_attention_mask_to_dense,
build_string_from_input); transformers is never imported here.
"""

from __future__ import annotations

import math

import numpy as np


def tile_arrangements(max_tiles: int) -> list[tuple[int, int]]:
    """Every (rows, cols) of at most max_tiles tiles; an arrangement's id is its index + 1 (0: no image)."""
    return [(rows, cols) for rows in range(1, max_tiles + 1) for cols in range(1, max_tiles + 1)
            if rows * cols <= max_tiles]


def aspect_ratio_id(rows: int, cols: int, max_tiles: int) -> int:
    return tile_arrangements(max_tiles).index((rows, cols)) + 1


def best_tiling(height: int, width: int, max_tiles: int, side: int) -> tuple[int, int]:
    """The canvas needing the smallest upscale, else the least downscale; the smallest area on ties
    (the first of equal areas, as argmin keeps it)."""
    arrangements = tile_arrangements(max_tiles)
    scales = [min(rows * side / height, cols * side / width) for rows, cols in arrangements]  # float64, as numpy
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    fits = [a for a, s in zip(arrangements, scales) if s == chosen]
    return min(fits, key=lambda a: a[0] * a[1])


def fitted_size(height: int, width: int, rows: int, cols: int, side: int) -> tuple[int, int]:
    """The image's size on its canvas: aspect ratio kept, upscaled to one tile's side at most."""
    target_h = min(max(height, side), rows * side)
    target_w = min(max(width, side), cols * side)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


def aspect_ratio_mask(tiles_per_image: list[list[int]], max_tiles: int) -> np.ndarray:
    """1 for each image's tiles; the first tile is 1 even for a row's padding images, as the processor sets it."""
    images = max((len(row) for row in tiles_per_image), default=0)
    mask = np.zeros((len(tiles_per_image), images, max_tiles), np.int32)
    mask[:, :, 0] = 1
    for b, row in enumerate(tiles_per_image):
        for i, tiles in enumerate(row):
            mask[b, i, :tiles] = 1
    return mask


def image_token_ranges(ids, image_token: int) -> list[tuple[int, int]]:
    """Each image's [start, end) of tokens that see it: from its own image token to the next one;
    the last image to the end; adjacent image tokens share the range of the last of them."""
    starts = [i for i, token in enumerate(ids) if token == image_token]
    ranges = [[start, end] for start, end in zip(starts, starts[1:] + [len(ids)])]
    end_after = len(ids)
    for run in reversed(ranges):
        if run[1] == run[0] + 1:
            run[1] = end_after
        end_after = run[1]
    return [(start, end) for start, end in ranges]


def cross_attention_mask(tokens: np.ndarray, image_token: int, tiles_per_image: list[list[int]],
                         max_tiles: int) -> np.ndarray:
    """int32 [batch, seq, images, max_tiles]: 1 where a token sees an image's tile."""
    batch, seq = tokens.shape
    images = max((len(row) for row in tiles_per_image), default=0)
    mask = np.zeros((batch, seq, images, max_tiles), np.int32)
    for b, row in enumerate(tiles_per_image):
        for i, ((start, end), tiles) in enumerate(zip(image_token_ranges(tokens[b].tolist(), image_token), row)):
            mask[b, start:end, i, :tiles] = 1
    return mask


def with_begin_after_leading_images(prompt: str, bos: str, marker: str) -> str:
    """MllamaProcessor's prompt: the begin-of-text token after any leading image markers, unless
    the prompt holds it already."""
    if bos in prompt:
        return prompt
    leading = 0
    while prompt.startswith(marker):
        prompt, leading = prompt[len(marker):], leading + 1
    return marker * leading + bos + prompt
