"""Image-text records to a token file and its image sidecar: `mxc tokenize DATA.jsonl --model MODEL`.

A record is one JSON line, `{"text": "... <marker> ...", "images": ["a.png", ...]}`: the text holds
the model's image marker where each image goes, in order (Gemma 3 `<start_of_image>`, Llama 4 and
Llama 3.2 Vision `<|image|>`, as `--image` takes them), and the image paths are relative to the
JSONL file's folder. Each image is preprocessed by the model's own preprocessing
(runtime/image_preprocess.py), each marker expanded as the processor expands it, and the expanded
text tokenized whole, as the processor tokenizes it. The tokens are then cut at the placeholder
runs (one run of the tower's placeholders per tile; Llama 3.2 Vision: one image token per image)
and written by `write_image_tokens`, so the sidecar is the one the Python writer makes. Text files
and records without images are documents without images. Documents get no begin-of-text token
(the token file's documents never do); every one ends with the end-of-document id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from mxc.runtime.tokenize import Tokenizer, TokenizerError, documents


def load_tower(model: str):
    """The vision tower of MODEL: an imported model directory, a zoo name or a .mspec reference."""
    from mxc.compiler.hf.model_dir import load_spec  # the spec's machinery, only when images are asked for
    from mxc.spec.diagnostics import SpecError

    try:
        spec = load_spec(model)
    except (OSError, ValueError, SpecError) as err:
        raise TokenizerError(f"--model {model}: {str(err).splitlines()[0]}") from None
    if spec.vision is None:
        raise TokenizerError(f"--model {model}: {spec.name} has no vision tower to take images")
    return spec.vision


def records(path: Path, text_key: str, images_key: str, split: str) -> Iterator[tuple[str, str, list[Path]]]:
    """(where, text, image paths) per document; only .jsonl records carry images."""
    if path.suffix != ".jsonl":
        for number, text in enumerate(documents(path, split, text_key), 1):
            yield f"{path}: document {number}", text, []
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{where}: not a JSON record ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise TokenizerError(f"{where}: no {text_key!r} text field")
            images = record.get(images_key, [])
            if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
                raise TokenizerError(f"{where}: {images_key!r} must be a list of image file paths")
            yield where, record[text_key], [path.parent / p for p in images]


class ImageRecords:
    """One tower's way of turning a record into write_image_tokens parts."""

    def __init__(self, tower, tokenizer: Tokenizer):
        from mxc.compiler.kinds.vision import tokens_per_image
        from mxc.runtime.image_preprocess import image_marker, preprocessing_for

        if tokenizer.token_text is None:
            raise TokenizerError("images need the model's tokenizer (a tokenizer.json: --tokenizer, or a model "
                                 "directory that holds one), to write their marker and placeholder tokens")
        self.tower, self.tokenizer = tower, tokenizer
        try:
            self.tiled = preprocessing_for(tower).family == "mllama"
            self.marker = image_marker(tower, self.token_text)
        except ValueError as err:
            raise TokenizerError(str(err)) from None
        self.placeholder = tower.entry.token
        # the text's placeholders per tile (Llama 3.2 Vision: one image token per image)
        self.per_tile = 1 if self.tiled else tokens_per_image(tower)

    def token_text(self, token: int) -> str:
        from mxc.runtime.image_preprocess import ImageInputError

        text = self.tokenizer.token_text(token)
        if text is None:
            raise ImageInputError(f"the tokenizer has no token {token}, which the model's image entry names")
        return text

    def parts(self, where: str, text: str, files: list[Path]) -> list:
        """Text id arrays and images (3-D tiles, or TiledImage for a tiled tower), in order."""
        from mxc.runtime.image_preprocess import ImageInputError, expand_image_markers, pixel_values

        try:
            images = [pixel_values(self.tower, f) for f in files]
            text = expand_image_markers(text, self.tower, images, self.token_text)
        except ImageInputError as err:
            raise TokenizerError(f"{where}: {str(err).removeprefix('--image: ')}") from None
        ids = np.asarray(self.tokenizer.encode(text), np.int64)
        pictures = self._sidecar_images(images)
        runs = _runs(ids == self.placeholder)
        tiles = sum((end - start) // self.per_tile for start, end in runs)
        if tiles != len(pictures) or any((end - start) % self.per_tile for start, end in runs):
            placeholders = sum(end - start for start, end in runs)
            raise TokenizerError(f"{where}: the text holds {placeholders} placeholder token(s) ({self.placeholder}) "
                                 f"for {len(pictures)} image tile(s) of {self.per_tile}; write only the marker "
                                 f"{self.marker!r} where each image goes")
        parts, start, pictures = [], 0, iter(pictures)
        for run_start, run_end in runs:
            parts.append(ids[start:run_start])
            parts.extend(next(pictures) for _ in range((run_end - run_start) // self.per_tile))
            start = run_end
        parts.append(ids[start:])
        return [part for part in parts if not isinstance(part, np.ndarray) or part.ndim != 1 or len(part)]

    def _sidecar_images(self, images: list) -> list:
        from mxc.runtime.image_file import TiledImage
        from mxc.runtime.image_preprocess import padded_tiles
        from mxc.runtime.image_tiles import aspect_ratio_id

        if not self.tiled:  # every tile (Llama 4's global tile included) fills its own placeholder run
            return [tile for image in images for tile in image.pixels]
        most = self.tower.tiles.max
        return [TiledImage(padded_tiles(image, most), aspect_ratio_id(image.tile_rows, image.tile_cols, most))
                for image in images]


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of True."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def tokenize_with_images(inputs: list[str], output: str, *, tokenizer: Tokenizer, model: str, split: str = "file",
                         text_key: str = "text", images_key: str = "images") -> dict:
    """Writes `output` and its sidecar `output.images/`; returns {tokens, documents, images, ...}."""
    from mxc.runtime.image_file import write_image_tokens

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TokenizerError(f"no such input file: {', '.join(missing)}")
    tower = load_tower(model)
    maker = ImageRecords(tower, tokenizer)
    # The writer stacks every image's pixels in memory before writing them.
    examples = [maker.parts(where, text, files) for path in paths
                for where, text, files in records(path, text_key, images_key, split)]
    tokens, images = write_image_tokens(output, examples, vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id,
                                        placeholder=maker.placeholder, tokens_per_image=maker.per_tile,
                                        tokenizer=tokenizer.name)
    return {"tokens": tokens, "documents": len(examples), "images": images, "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": tokenizer.name}


def model_tokenizer(model: str, tokenizer: str | None) -> str | None:
    """--tokenizer, else the model directory when it holds a tokenizer.json (as import-hf writes it)."""
    if tokenizer is None and (Path(model) / "tokenizer.json").is_file():
        return model
    return tokenizer
