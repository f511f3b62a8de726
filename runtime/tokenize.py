"""Text to a token file: with the user's tokenizer (HF `tokenizers` JSON or sentencepiece), or bytes.

Documents: a `.jsonl` input holds one document per line (its `text` field); any other input is
UTF-8 text, one document per file, or per paragraph / line with `split=`. Every document is
followed by the tokenizer's end-of-document id, which the packer uses to keep attention and the
loss inside each document.

The byte-level fallback needs no tokenizer: ids 0-255 are the UTF-8 bytes and 256 ends a
document, so a model needs a vocabulary of at least 257 (llama3-tiny has 512).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mxc.runtime.token_file import write_tokens

BYTE_EOD_ID = 256
BYTE_VOCAB_SIZE = 257
# End-of-document tokens of the tokenizers users bring, most specific first (Llama 3, GPT-2/NeoX,
# Llama 2/Mistral, Gemma, Qwen).
EOD_TOKEN_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
SPLITS = ("file", "paragraph", "line")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or has no end-of-document token."""


@dataclass(frozen=True)
class Tokenizer:
    name: str  # recorded in the token file's header
    vocab_size: int
    eod_id: int
    encode: Callable[[str], list[int]]
    token_text: Callable[[int], str | None] | None = None  # an id's text (None: no such id); bytes have none


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("bytes", BYTE_VOCAB_SIZE, BYTE_EOD_ID, lambda text: list(text.encode("utf-8")))


def hf_tokenizer(path: Path, eod_token: str | None = None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer  # ships with transformers

    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as err:
        raise TokenizerError(f"{path}: not a HuggingFace tokenizers JSON file ({err})") from None
    names = (eod_token,) if eod_token else EOD_TOKEN_NAMES
    eod_id = next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
    if eod_id is None:
        raise TokenizerError(f"{path}: none of {', '.join(names)} is in the vocabulary; "
                             f"name the end-of-document token with --eod-token")
    return Tokenizer(path.name, tokenizer.get_vocab_size(with_added_tokens=True), eod_id,
                     lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.id_to_token)


def sentencepiece_tokenizer(path: Path, eod_token: str | None = None) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(f"{path} is a sentencepiece model, and the sentencepiece package is not "
                             f"installed: pip install sentencepiece (or pass a tokenizer.json)") from None
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    eod_id = processor.piece_to_id(eod_token) if eod_token else processor.eos_id()
    if eod_id is None or eod_id < 0 or (eod_token and processor.id_to_piece(eod_id) != eod_token):
        raise TokenizerError(f"{path}: no end-of-document token; name one with --eod-token")
    size = processor.get_piece_size()
    return Tokenizer(path.name, size, eod_id, lambda text: processor.encode(text),
                     lambda token: processor.id_to_piece(token) if 0 <= token < size else None)


def load_tokenizer(path: str | None, eod_token: str | None = None) -> Tokenizer:
    """A `.model` file is sentencepiece, anything else HF JSON (a directory: its tokenizer.json, as
    an imported model directory holds it); None is the byte-level fallback."""
    if path is None:
        return byte_tokenizer()
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file")
    if path.suffix == ".model":
        return sentencepiece_tokenizer(path, eod_token)
    return hf_tokenizer(path, eod_token)


def documents(path: Path, split: str = "file", text_key: str = "text") -> Iterator[str]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if text_key not in record:
                        raise TokenizerError(f"{path}:{number}: no {text_key!r} field")
                    yield record[text_key]
        return
    text = path.read_text(encoding="utf-8")
    if split == "file":
        parts = [text]
    elif split == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    else:
        parts = text.splitlines()
    yield from (part for part in parts if part.strip())


def token_chunks(tokenizer: Tokenizer, inputs: Iterable[Path], split: str, text_key: str,
                 counts: dict) -> Iterator[np.ndarray]:
    for path in inputs:
        for document in documents(path, split, text_key):
            counts["documents"] = counts.get("documents", 0) + 1
            yield np.asarray([*tokenizer.encode(document), tokenizer.eod_id], np.int64)


def tokenize_files(inputs: list[str], output: str, *, tokenizer: Tokenizer, split: str = "file",
                   text_key: str = "text") -> dict:
    """Writes `output` (mxc .bin); returns {tokens, documents, vocab_size, eod_id, tokenizer}."""
    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TokenizerError(f"no such input file: {', '.join(missing)}")
    counts: dict = {}
    tokens = write_tokens(output, token_chunks(tokenizer, paths, split, text_key, counts),
                          vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id, tokenizer=tokenizer.name)
    return {"tokens": tokens, "documents": counts.get("documents", 0), "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": tokenizer.name}
