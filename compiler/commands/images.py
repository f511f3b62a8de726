"""`--images INPUTS.npz` for forward and generate: image inputs as the model's HF processor makes them
(`pixel_values` [images, channels, height, width]; for Gemma 3 also `token_type_ids` [batch, seq]),
checked against the model and the prompt's placeholder tokens. `--image FILE.png` (repeatable)
instead preprocesses image files as the processor would (runtime/image_preprocess.py); with a text
`--prompt`, each image marker the prompt holds is expanded as the processor expands it."""

from __future__ import annotations

import zipfile

from mxc.compiler.commands import UserError


def add_images_argument(parser) -> None:
    parser.add_argument("--images", metavar="INPUTS.npz",
                        help="image inputs as the HF processor makes them: pixel_values [images, channels, "
                             "height, width] (and token_type_ids [batch, seq] for Gemma 3; Llama 3.2 Vision: "
                             "tiled pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask); "
                             "the prompt holds the image tokens")
    parser.add_argument("--image", action="append", metavar="FILE.png",
                        help="an image file, preprocessed as the model's HF processor does (repeat for more "
                             "images, in prompt order); with --prompt TEXT write the image marker where each "
                             "image goes (Gemma 3: <start_of_image>, Llama 4 and Llama 3.2 Vision: <|image|>); "
                             "with token ids, the placeholders as the processor lays them out")


def image_files(files: list[str] | None, spec) -> list:
    """--image FILE... preprocessed for spec's tower: one ImagePixels per file, in order."""
    from mxc.runtime.image_preprocess import ImageInputError, pixel_values

    if not files:
        return []
    if spec.vision is None:
        raise UserError(f"--image: {spec.name} has no vision tower")
    try:
        return [pixel_values(spec.vision, path) for path in files]
    except ImageInputError as err:
        raise UserError(str(err)) from None


def text_prompt_ids(tokenizer, prompt: str, chat: bool, spec, images: list):
    """A text prompt's ids [1, length] with each image marker expanded as the processor does it
    (after the chat template, as the processor sees the rendered text)."""
    import numpy as np

    from mxc.runtime.image_preprocess import ImageInputError, expand_image_markers, image_marker, preprocessing_for
    from mxc.runtime.image_tiles import with_begin_after_leading_images

    def token_text(token: int) -> str:
        text = tokenizer.tokenizer.id_to_token(token)
        if text is None:
            raise ImageInputError(f"--image: the tokenizer has no token {token}, which {spec.name}'s image "
                                  f"entry names")
        return text

    text = tokenizer.chat_text(prompt) if chat else prompt
    try:
        bos = tokenizer.special("bos_token")
        if preprocessing_for(spec.vision).family == "mllama" and bos and not chat:
            text = with_begin_after_leading_images(text, bos, image_marker(spec.vision, token_text))
        text = expand_image_markers(text, spec.vision, images, token_text)
    except ImageInputError as err:
        raise UserError(str(err)) from None
    return np.asarray([tokenizer.encode(text, special_tokens=not chat)], np.int32)


def read_images(path: str | None, spec, tokens, images: list | None = None) -> dict:
    """{} without --images or --image; else {"pixel_values": float32, "token_type_ids": int32 or absent}.
    `images`: the --image files' ImagePixels (image_files)."""
    import numpy as np

    if path is not None and images:
        raise UserError("--images and --image are two ways to give the same inputs: give one")
    if path is None and not images:
        return {}
    if spec.vision is None:
        raise UserError(f"--images: {spec.name} has no vision tower")
    if images:
        arrays = {"pixel_values": np.concatenate([image.pixels for image in images])}
    else:
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise UserError(f"--images: cannot read {path}: {err}") from None
    from mxc.compiler.kinds.vision import tokens_per_image  # the spec's machinery: not at parser build
    from mxc.spec.ir import CrossAttentionEntry

    tower = spec.vision
    if isinstance(tower.entry, CrossAttentionEntry):
        if images:
            arrays = _tiled_image_inputs(images, tower, tokens)
        return _cross_attention_inputs(arrays, tower, tokens)
    pixels = arrays.get("pixel_values")
    want = (tower.patches.channels, tower.image, tower.image)
    if pixels is None or pixels.ndim != 4 or tuple(pixels.shape[1:]) != want:
        got = "nothing" if pixels is None else f"{pixels.dtype}{list(pixels.shape)}"
        raise UserError(f"--images: pixel_values must be [images, {', '.join(map(str, want))}], got {got}")
    placeholders = int((tokens == tower.entry.token).sum())
    per_image = tokens_per_image(tower)
    if placeholders != len(pixels) * per_image:
        counted = (f"--image: {len(images)} image file(s) in {len(pixels)} tile(s)" if images
                   else f"--images: {len(pixels)} image(s)")
        raise UserError(f"{counted} of {per_image} tokens need {len(pixels) * per_image} placeholder tokens "
                        f"({tower.entry.token}); the prompt has {placeholders}")
    inputs = {"pixel_values": pixels.astype(np.float32)}
    if "token_type_ids" in arrays:
        types = arrays["token_type_ids"]
        if types.shape != tokens.shape:
            raise UserError(f"--images: token_type_ids {list(types.shape)} must have the prompt's shape "
                            f"{list(tokens.shape)}")
        inputs["token_type_ids"] = types.astype(np.int32)
    return inputs


def _tiled_image_inputs(images: list, tower, tokens) -> dict:
    """--image files for Llama 3.2 Vision as MllamaProcessor batches them: row b's k-th image token
    takes the next file; images and tiles padded with zeros; the cross-attention mask from the tokens."""
    import numpy as np

    from mxc.runtime.image_preprocess import padded_tiles
    from mxc.runtime.image_tiles import aspect_ratio_id, aspect_ratio_mask, cross_attention_mask

    per_row = (tokens == tower.entry.token).sum(axis=1).tolist()
    if sum(per_row) != len(images):
        raise UserError(f"--image: {len(images)} image file(s) for {sum(per_row)} image token(s) "
                        f"({tower.entry.token}) in the prompt; each image needs one, where it goes")
    max_tiles, rows = tower.tiles.max, []
    for count in per_row:
        rows.append(images[:count])
        images = images[count:]
    pixels = np.zeros((len(rows), max(per_row), max_tiles, tower.patches.channels, tower.image, tower.image),
                      np.float32)
    ids = np.zeros(pixels.shape[:2], np.int32)
    for b, row in enumerate(rows):
        for i, image in enumerate(row):
            pixels[b, i] = padded_tiles(image, max_tiles)
            ids[b, i] = aspect_ratio_id(image.tile_rows, image.tile_cols, max_tiles)
    tiles = [[len(image.pixels) for image in row] for row in rows]
    return {"pixel_values": pixels, "aspect_ratio_ids": ids, "aspect_ratio_mask": aspect_ratio_mask(tiles, max_tiles),
            "cross_attention_mask": cross_attention_mask(np.asarray(tokens), tower.entry.token, tiles, max_tiles)}


def _cross_attention_inputs(arrays: dict, tower, tokens) -> dict:
    """Llama 3.2 Vision's four inputs, their shapes checked against one another and the prompt."""
    import numpy as np

    from mxc.compiler.lower.cross_attention import INPUTS as CROSS_INPUTS

    missing = [name for name in CROSS_INPUTS if name not in arrays]
    if missing:
        raise UserError(f"--images: Llama 3.2 Vision needs {', '.join(CROSS_INPUTS)}; missing {', '.join(missing)}")
    pixels, ids, tile_mask, cross = (arrays[name] for name in CROSS_INPUTS)
    tile = (tower.patches.channels, tower.image, tower.image)
    batch = tokens.shape[0]
    if pixels.ndim != 6 or pixels.shape[0] != batch or tuple(pixels.shape[3:]) != tile \
            or pixels.shape[2] != tower.tiles.max:
        raise UserError(f"--images: pixel_values must be [{batch}, images, {tower.tiles.max}, "
                        f"{', '.join(map(str, tile))}], got {list(pixels.shape)}")
    images = pixels.shape[:3]
    expected = {"aspect_ratio_ids": images[:2], "aspect_ratio_mask": images,
                "cross_attention_mask": (batch, tokens.shape[1], *images[1:])}
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != tuple(shape):
            raise UserError(f"--images: {name} must be {list(shape)}, got {list(arrays[name].shape)}")
    if ids.min() < 0 or ids.max() > tower.tiles.aspect_ratios:
        raise UserError(f"--images: aspect_ratio_ids run from 0 to {tower.tiles.aspect_ratios}")
    return {"pixel_values": pixels.astype(np.float32), "aspect_ratio_ids": ids.astype(np.int32),
            "aspect_ratio_mask": tile_mask.astype(np.int32), "cross_attention_mask": cross.astype(np.int32)}

