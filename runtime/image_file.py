"""Images beside a token file: for image-text training data.

A token file `X.bin` (or `X.npy`) may have a sidecar folder `X.bin.images/` holding
    pixels.npy    [images, channels, height, width] float32 or float16: each image as the
                  model's processor makes it (resized, rescaled, normalised); for a tiled tower
                  (Llama 3.2 Vision) [images, tiles, channels, height, width], with
    aspect_ratio_ids.npy  [images] int32: each image's arrangement of tiles (MllamaProcessor's id)
    offsets.npy   [images] int64, ascending: the token index in X.bin of the image's first
                  placeholder token
    meta.json     {"images": n, "placeholder": <token id>, "tokens_per_image": T,
                   "tokens_fingerprint": <the token file's fingerprint>}
Image i's placeholder run is tokens [offsets[i], offsets[i] + T), all equal to `placeholder`;
every placeholder of the token file belongs to exactly one image. Both arrays are read as memory
maps. The fingerprint ties the sidecar to its token file: a sidecar beside other tokens is
refused. `write_image_tokens` writes both from (text, image, text, ...) examples.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from mxc.runtime.token_file import TokenFile, TokenFileError, open_tokens, write_tokens

SIDECAR_SUFFIX = ".images"


@dataclass(frozen=True)
class ImageFile:
    path: Path  # the sidecar folder
    pixels: np.ndarray  # [images, channels, height, width], memory-mapped
    offsets: np.ndarray  # [images] int64
    placeholder: int
    tokens_per_image: int
    aspect_ratio_ids: np.ndarray | None = None  # [images] int32, for tiled images only

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(n) for n in self.pixels.shape[1:])


def sidecar_path(token_path: str | os.PathLike) -> Path:
    token_path = Path(token_path)
    return token_path.with_name(token_path.name + SIDECAR_SUFFIX)


def open_images(tokens: TokenFile) -> ImageFile | None:
    """The sidecar of `tokens`, checked against it; None where there is none."""
    folder = sidecar_path(tokens.path)
    if not folder.is_dir():
        return None
    try:
        meta = json.loads((folder / "meta.json").read_text())
        pixels = np.load(folder / "pixels.npy", mmap_mode="r")
        offsets = np.asarray(np.load(folder / "offsets.npy"), np.int64)
        tiled = (folder / "aspect_ratio_ids.npy").exists()
        aspect_ratio_ids = np.asarray(np.load(folder / "aspect_ratio_ids.npy"), np.int32) if tiled else None
    except (OSError, ValueError) as err:
        raise TokenFileError(f"{folder}: unreadable image sidecar: {err}") from None
    if meta.get("tokens_fingerprint") != tokens.fingerprint:
        raise TokenFileError(f"{folder}: the images were written for other tokens than {tokens.path}'s "
                             f"(fingerprint {str(meta.get('tokens_fingerprint'))[:12]}… there, "
                             f"{tokens.fingerprint[:12]}… here)")
    per_image, placeholder = int(meta["tokens_per_image"]), int(meta["placeholder"])
    if pixels.ndim != 4 + tiled or offsets.ndim != 1 or len(pixels) != len(offsets) \
            or len(offsets) != meta.get("images") or (tiled and aspect_ratio_ids.shape != offsets.shape):
        raise TokenFileError(f"{folder}: pixels {list(pixels.shape)} and offsets {list(offsets.shape)} do not "
                             f"describe {meta.get('images')} images")
    if len(offsets) and (np.any(np.diff(offsets) < per_image) or offsets[0] < 0
                         or offsets[-1] + per_image > len(tokens)):
        raise TokenFileError(f"{folder}: image offsets must ascend, {per_image} tokens apart at least, "
                             f"inside the token file's {len(tokens)} tokens")
    runs = offsets[:, None] + np.arange(per_image)
    if len(offsets) and np.any(np.asarray(tokens.tokens[runs.ravel()]) != placeholder):
        raise TokenFileError(f"{folder}: an image's {per_image} tokens are not all the placeholder {placeholder}")
    if int(np.count_nonzero(np.asarray(tokens.tokens) == placeholder)) != len(offsets) * per_image:
        raise TokenFileError(f"{folder}: the token file has placeholder tokens ({placeholder}) that belong "
                             f"to no image")
    return ImageFile(folder, pixels, offsets, placeholder, per_image, aspect_ratio_ids)


@dataclass(frozen=True)
class TiledImage:
    """An example's image for a tiled tower, as MllamaProcessor makes it: pixels [tiles, channels,
    height, width] (padded to the tower's most tiles) and the id of its tiles' arrangement."""

    pixels: np.ndarray
    aspect_ratio_id: int


def write_image_tokens(path: str | os.PathLike, examples: Iterable[Sequence[np.ndarray]], *, vocab_size: int,
                       eod_id: int, placeholder: int, tokens_per_image: int, begin: int | None = None,
                       end: int | None = None, tokenizer: str = "synthetic") -> tuple[int, int]:
    """Writes a token file and its image sidecar; returns (tokens, images).

    Each example is a sequence of parts: a 1-D integer array is text (token ids), a 3-D array
    [channels, height, width] or a TiledImage an image, written as `begin`, T placeholders, `end`
    (the processor's spelling; begin and end left out where None). An example ends with `eod_id`.
    A file's images are all plain or all tiled."""
    tokens, images, offsets, aspect_ratio_ids = [], [], [], []
    count = 0
    for example in examples:
        for part in example:
            tiled = isinstance(part, TiledImage)
            if tiled:
                aspect_ratio_ids.append(part.aspect_ratio_id)
                if np.ndim(part.pixels) != 4:
                    raise ValueError(f"a tiled image is [tiles, channels, height, width], "
                                     f"got {list(np.shape(part.pixels))}")
            part = np.asarray(part.pixels if tiled else part)
            if part.ndim == 3 or tiled:
                run = ([begin] if begin is not None else []) + [placeholder] * tokens_per_image \
                    + ([end] if end is not None else [])
                offsets.append(count + (begin is not None))
                images.append(part)
                part = np.asarray(run, np.int64)
            elif part.ndim != 1:
                raise ValueError(f"an example's part is text [n] or an image [channels, height, width], "
                                 f"got shape {list(part.shape)}")
            tokens.append(part.astype(np.int64))
            count += len(part)
        tokens.append(np.asarray([eod_id], np.int64))
        count += 1
    if aspect_ratio_ids and len(aspect_ratio_ids) != len(images):
        raise ValueError("an image file's images are all tiled (TiledImage) or none")
    write_tokens(path, tokens, vocab_size=vocab_size, eod_id=eod_id, tokenizer=tokenizer)
    written = open_tokens(path)
    folder = sidecar_path(path)
    temp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        pixels = np.stack(images) if images else np.zeros((0, 3, 1, 1), np.float32)
        np.save(temp / "pixels.npy", pixels)
        np.save(temp / "offsets.npy", np.asarray(offsets, np.int64))
        if aspect_ratio_ids:
            np.save(temp / "aspect_ratio_ids.npy", np.asarray(aspect_ratio_ids, np.int32))
        (temp / "meta.json").write_text(json.dumps(
            {"images": len(offsets), "placeholder": placeholder, "tokens_per_image": tokens_per_image,
             "tokens_fingerprint": written.fingerprint}, sort_keys=True))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(temp, folder)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return count, len(offsets)
