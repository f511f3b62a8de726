"""`--images INPUTS.npz` for forward and generate: image inputs as the model's HF processor makes them
(`pixel_values` [images, channels, height, width]; for Gemma 3 also `token_type_ids` [batch, seq]),
checked against the model and the prompt's placeholder tokens."""

from __future__ import annotations

import zipfile

from mxc.compiler.commands import UserError
from mxc.compiler.kinds.vision import tokens_per_image


def add_images_argument(parser) -> None:
    parser.add_argument("--images", metavar="INPUTS.npz",
                        help="image inputs as the HF processor makes them: pixel_values [images, channels, "
                             "height, width] (and token_type_ids [batch, seq] for Gemma 3); the prompt holds "
                             "the image placeholder tokens")


def read_images(path: str | None, spec, tokens) -> dict:
    """{} without --images; else {"pixel_values": float32, "token_type_ids": int32 or absent}."""
    import numpy as np

    if path is None:
        return {}
    if spec.vision is None:
        raise UserError(f"--images: {spec.name} has no vision tower")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise UserError(f"--images: cannot read {path}: {err}") from None
    tower = spec.vision
    pixels = arrays.get("pixel_values")
    want = (tower.patches.channels, tower.image, tower.image)
    if pixels is None or pixels.ndim != 4 or tuple(pixels.shape[1:]) != want:
        got = "nothing" if pixels is None else f"{pixels.dtype}{list(pixels.shape)}"
        raise UserError(f"--images: pixel_values must be [images, {', '.join(map(str, want))}], got {got}")
    placeholders = int((tokens == tower.entry.token).sum())
    per_image = tokens_per_image(tower)
    if placeholders != len(pixels) * per_image:
        raise UserError(f"--images: {len(pixels)} image(s) of {per_image} tokens need "
                        f"{len(pixels) * per_image} placeholder tokens ({tower.entry.token}); "
                        f"the prompt has {placeholders}")
    inputs = {"pixel_values": pixels.astype(np.float32)}
    if "token_type_ids" in arrays:
        types = arrays["token_type_ids"]
        if types.shape != tokens.shape:
            raise UserError(f"--images: token_type_ids {list(types.shape)} must have the prompt's shape "
                            f"{list(tokens.shape)}")
        inputs["token_type_ids"] = types.astype(np.int32)
    return inputs
