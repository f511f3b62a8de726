"""A request's images placed in a serving artifact's image slots.

A vision model's prefill (`mxc compile --serve`) takes each batch row's images in a fixed number
of slots: pixel_values [batch, slots, ...] and image_mask [batch, slots] (False for an empty slot),
and for Llama 3.2 Vision also aspect_ratio_ids, aspect_ratio_mask and cross_attention_mask. The
manifest records the slots (run.serve_images: the image token, the tokens each image fills, the
slots per row) and the prefill's inputs their shapes. `--images INPUTS.npz` holds the images as
the HF processor makes them:

- placeholder towers (Gemma 3, Llama 4): pixel_values [images, channels, height, width], one entry
  per image (per tile for Llama 4), in prompt order over all rows; row r takes as many as its
  placeholders fill (tokens_per_image each), in order. token_type_ids, if given, must mark exactly
  the placeholders: the compiled prefill builds the image mask from them.
- Llama 3.2 Vision: pixel_values [requests, images, tiles, ...], aspect_ratio_ids [requests, images],
  aspect_ratio_mask [requests, images, tiles], cross_attention_mask [requests, prompt, images, tiles];
  row r's image k goes to slot k.

The result has one entry per request (the driver picks a group's rows from it). A prompt row that
holds images must fit the prefill whole (a longer row's tail runs through decode steps, which
take no images).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ImageSlotError(ValueError):
    """Image inputs that do not fit the artifact's slots; the message names what does not match."""


@dataclass(frozen=True)
class ImageSlots:
    entry: str  # "placeholder" or "cross_attention"
    token: int  # the placeholder (or image) token
    tokens_per_image: int  # placeholders one image fills (a cross-attention image: its one token)
    inputs: dict  # name -> (shape without the batch axis, numpy dtype name), as the prefill takes them

    @property
    def slots(self) -> int:
        return self.inputs["pixel_values"][0][0]

    def empty(self, rows: int) -> dict:
        """Inputs of `rows` requests without images (every slot masked)."""
        return {name: np.zeros((rows, *shape), dtype) for name, (shape, dtype) in self.inputs.items()}

    def place(self, arrays: dict, prompts: np.ndarray, prompt_len: int) -> dict:
        """The processor's arrays (an npz's contents) for `prompts` [requests, width] (negative ids pad a
        shorter row, runtime/generate.py) -> per-request slot inputs [requests, ...]; raises
        ImageSlotError naming what does not match."""
        real = prompts >= 0
        lengths = real.sum(axis=1)
        if self.entry == "cross_attention":
            placed = self._place_cross(arrays, prompts)
        else:
            placed = self._place_placeholders(arrays, prompts, real)
        holding = placed["image_mask"].any(axis=1)
        long = np.flatnonzero(holding & (lengths > prompt_len))
        if long.size:
            raise ImageSlotError(f"prompt row {long[0]} holds images and {lengths[long[0]]} tokens; the artifact's "
                                 f"prefill takes {prompt_len} (a longer row's tail is decoded, without images)")
        return placed

    def _place_placeholders(self, arrays: dict, prompts: np.ndarray, real: np.ndarray) -> dict:
        shape = self.inputs["pixel_values"][0][1:]
        pixels = arrays.get("pixel_values")
        if pixels is None or pixels.ndim != 4 or tuple(pixels.shape[1:]) != tuple(shape):
            got = "nothing" if pixels is None else f"{pixels.dtype}{list(pixels.shape)}"
            raise ImageSlotError(f"--images: pixel_values must be [images, {', '.join(map(str, shape))}], got {got}")
        placeholders = ((prompts == self.token) & real).sum(axis=1)
        counts = placeholders // self.tokens_per_image
        uneven = np.flatnonzero(placeholders % self.tokens_per_image)
        if uneven.size:
            raise ImageSlotError(f"--images: prompt row {uneven[0]} has {placeholders[uneven[0]]} placeholder tokens "
                                 f"({self.token}), not a multiple of the {self.tokens_per_image} one image fills")
        if counts.sum() != len(pixels):
            raise ImageSlotError(f"--images: {len(pixels)} image(s) of {self.tokens_per_image} tokens need "
                                 f"{len(pixels) * self.tokens_per_image} placeholder tokens ({self.token}); the prompts "
                                 f"have {int(placeholders.sum())}")
        self._check_slots(counts)
        if "token_type_ids" in arrays:
            types = arrays["token_type_ids"]
            if types.shape != prompts.shape or not np.array_equal(types.astype(bool) & real,
                                                                  (prompts == self.token) & real):
                raise ImageSlotError("--images: token_type_ids must mark exactly the placeholder tokens of the "
                                     f"prompt {list(prompts.shape)} (the compiled prefill builds the image mask from "
                                     "them)")
        placed = self.empty(len(prompts))
        first = np.concatenate([[0], np.cumsum(counts)])
        for row, count in enumerate(counts):
            placed["pixel_values"][row, :count] = pixels[first[row]:first[row] + count]
            placed["image_mask"][row, :count] = True
        return placed

    def _place_cross(self, arrays: dict, prompts: np.ndarray) -> dict:
        names = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")
        missing = [name for name in names if name not in arrays]
        if missing:
            raise ImageSlotError(f"--images: Llama 3.2 Vision needs {', '.join(names)}; missing {', '.join(missing)}")
        pixels = arrays["pixel_values"]
        tile = self.inputs["pixel_values"][0][1:]
        requests, width = prompts.shape
        if pixels.ndim != 6 or pixels.shape[0] != requests or tuple(pixels.shape[2:]) != tuple(tile):
            raise ImageSlotError(f"--images: pixel_values must be [{requests}, images, {', '.join(map(str, tile))}], "
                                 f"got {list(pixels.shape)}")
        images = pixels.shape[1]
        tiles = tile[0]
        expected = {"aspect_ratio_ids": (requests, images), "aspect_ratio_mask": (requests, images, tiles),
                    "cross_attention_mask": (requests, width, images, tiles)}
        for name, shape in expected.items():
            if tuple(arrays[name].shape) != shape:
                raise ImageSlotError(f"--images: {name} must be {list(shape)}, got {list(arrays[name].shape)}")
        self._check_slots(np.full(requests, images))
        prompt_len = self.inputs["cross_attention_mask"][0][0]
        placed = self.empty(requests)
        placed["pixel_values"][:, :images] = pixels
        placed["image_mask"][:, :images] = True
        placed["aspect_ratio_ids"][:, :images] = arrays["aspect_ratio_ids"]
        placed["aspect_ratio_mask"][:, :images] = arrays["aspect_ratio_mask"]
        rows = min(width, prompt_len)  # a longer row holding images is refused by place()
        placed["cross_attention_mask"][:, :rows, :images] = arrays["cross_attention_mask"][:, :rows]
        return placed

    def _check_slots(self, counts: np.ndarray) -> None:
        over = np.flatnonzero(counts > self.slots)
        if over.size:
            raise ImageSlotError(f"--images: prompt row {over[0]} holds {counts[over[0]]} images; the artifact has "
                                 f"{self.slots} image slot(s) per row (mxc compile --images-per-row)")


def image_slots_of(manifest, prefill) -> ImageSlots | None:
    """The artifact's image slots, from its manifest and its prefill function's inputs; None for a
    prefill that takes no images."""
    record = manifest.run.get("serve_images")
    if record is None or "images" not in prefill.arguments:
        return None
    index = prefill.arguments.index("images")
    inputs = {leaf.path[1]: (tuple(leaf.shape[1:]), leaf.dtype) for leaf in prefill.inputs if leaf.path[0] == index}
    return ImageSlots(entry=record["entry"], token=record["token"], tokens_per_image=record["tokens_per_image"],
                      inputs=inputs)
