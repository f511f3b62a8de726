"""Token files: one flat array of token ids, read as a memory map so no corpus is loaded whole.

Two formats are read:

* `.npy`: a 1-D integer array (numpy's own format); it carries no end-of-document id, so the
  reader is told one (`eod_id=`) or the file is one long document.
* `.bin`, mxc's own, written by `mxc tokenize`:

      bytes 0..7     magic b"MXCTOKS1"
      bytes 8..11    n, the length of the JSON header in bytes (uint32, little-endian)
      bytes 12..     the header, UTF-8 JSON padded with spaces (mxc writes n = 500, so the
                     tokens start at byte 512, aligned for any reader; readers accept any n):
                       {"dtype": "uint16" | "uint32", "tokens": <count>,
                        "eod_id": <int> | null, "vocab_size": <int> | null,
                        "tokenizer": "<what made the ids, e.g. bytes or a file name>",
                        "fingerprint": "<sha256 hex of the ids>"}
      bytes 12 + n.. the tokens, little-endian, `tokens` of them and nothing after

A document ends with `eod_id`; the packer (data.py) uses it to keep attention and the loss
inside each document. uint16 holds vocabularies up to 65,536 ids, uint32 the rest.

Fingerprint. A file's content is named by the sha256 of its ids written as little-endian int64,
so the same ids have one fingerprint whether a .bin holds them as uint16 or a .npy as int32. A
checkpoint records it, and a resume on other data of the same length is refused. `mxc tokenize`
writes it into the header as it streams the tokens; for a .npy, or a .bin written before the
header had it, it is computed (block by block, never the whole file in memory) the first time
it is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable

import numpy as np

from mxc.runtime.file_modes import give_new_file_mode

MAGIC = b"MXCTOKS1"
# Room reserved for the header, which is written again once the streamed token count is known.
RESERVED_HEADER_BYTES = 512 - len(MAGIC) - 4
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
FINGERPRINT_DTYPE = np.dtype("<i8")
FINGERPRINT_BLOCK_TOKENS = 1 << 22  # 32 MiB as int64 per block while hashing


class TokenFileError(ValueError):
    """A token file that cannot be read; the message says what is wrong with it."""


@dataclass(frozen=True)
class TokenFile:
    path: Path
    tokens: np.ndarray  # 1-D, memory-mapped
    eod_id: int | None
    vocab_size: int | None
    tokenizer: str | None
    recorded_fingerprint: str | None = None  # from the header, where mxc tokenize wrote one

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex of the ids as little-endian int64: the header's, else computed once here."""
        if self.recorded_fingerprint is not None:
            return self.recorded_fingerprint
        digest = hashlib.sha256()
        for start in range(0, len(self), FINGERPRINT_BLOCK_TOKENS):
            digest.update(_fingerprint_bytes(self.tokens[start:start + FINGERPRINT_BLOCK_TOKENS]))
        return digest.hexdigest()


def _fingerprint_bytes(ids: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(ids, dtype=FINGERPRINT_DTYPE)).cast("B")


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def open_tokens(path: str | os.PathLike, *, eod_id: int | None = None) -> TokenFile:
    """Memory-maps a `.npy` or mxc `.bin` token file. `eod_id` overrides the file's own."""
    path = Path(path)
    if not path.is_file():
        raise TokenFileError(f"{path}: no such token file")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TokenFileError(f"{path}: expected a 1-D integer array, found {tokens.ndim}-D {tokens.dtype}")
        # Checked once here, so a bad id fails before training rather than when its window is drawn.
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(np.int64).max):
            raise TokenFileError(f"{path}: token ids must lie in [0, 2**63), "
                                 f"found ids from {int(tokens.min())} to {int(tokens.max())}")
        return TokenFile(path, tokens, eod_id, None, None)
    header, offset = _read_header(path)
    dtype = DTYPES[header["dtype"]]
    count = header["tokens"]
    expected = offset + count * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise TokenFileError(f"{path}: header promises {count} tokens ({expected} bytes in all) "
                             f"but the file has {actual} bytes; it is truncated or was not written by mxc")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count \
        else np.zeros((0,), dtype)
    recorded = header.get("fingerprint")
    if recorded is not None and not (isinstance(recorded, str) and len(recorded) == 64
                                     and all(c in "0123456789abcdef" for c in recorded)):
        raise TokenFileError(f"{path}: header fingerprint {recorded!r} is not a sha256 hex digest")
    return TokenFile(path, tokens, header.get("eod_id") if eod_id is None else eod_id,
                     header.get("vocab_size"), header.get("tokenizer"), recorded)


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 4)
        if len(start) < len(MAGIC) + 4 or start[:len(MAGIC)] != MAGIC:
            raise TokenFileError(f"{path}: not an mxc token file (no {MAGIC!r} magic); "
                                 f"use `mxc tokenize` to make one, or a .npy array")
        (length,) = struct.unpack("<I", start[len(MAGIC):])
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TokenFileError(f"{path}: unreadable header: {err}") from None
    if not isinstance(header, dict):
        raise TokenFileError(f"{path}: header is not a JSON object (found {type(header).__name__}); "
                             f"use `mxc tokenize` to make a token file")
    if header.get("dtype") not in DTYPES or not isinstance(header.get("tokens"), int):
        raise TokenFileError(f"{path}: header needs dtype (one of {sorted(DTYPES)}) and a token count, "
                             f"found {header}")
    return header, len(MAGIC) + 4 + length


def _header_bytes(header: dict, size: int) -> bytes:
    """Magic, length and the JSON header padded with spaces to `size` bytes."""
    text = json.dumps(header, sort_keys=True).encode("utf-8")
    if len(text) > size:
        raise TokenFileError(f"token file header of {len(text)} bytes does not fit in {size}")
    return MAGIC + struct.pack("<I", size) + text + b" " * (size - len(text))


def write_tokens(path: str | os.PathLike, chunks: Iterable[np.ndarray], *, vocab_size: int,
                 eod_id: int | None, tokenizer: str) -> int:
    """Streams chunks of token ids into an mxc `.bin` file; returns the token count.

    The file appears whole or not at all: it is written beside its destination and renamed, with
    the mode the user's umask gives a new file."""
    path = Path(path)
    dtype_name = dtype_for_vocab(vocab_size)
    dtype = DTYPES[dtype_name]
    header = {"dtype": dtype_name, "tokens": 0, "eod_id": eod_id, "vocab_size": vocab_size,
              "tokenizer": tokenizer}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    digest = hashlib.sha256()
    try:
        give_new_file_mode(handle)  # a token file is data like any other the user writes
        with os.fdopen(handle, "wb") as f:
            f.write(_header_bytes(header, RESERVED_HEADER_BYTES))
            for chunk in chunks:
                chunk = np.asarray(chunk)
                if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab_size):
                    raise TokenFileError(f"token ids must lie in [0, {vocab_size}), "
                                         f"found {chunk.min()}..{chunk.max()}")
                f.write(chunk.astype(dtype, copy=False).tobytes())
                digest.update(_fingerprint_bytes(chunk.ravel()))
                count += chunk.size
            f.seek(0)
            f.write(_header_bytes({**header, "tokens": count, "fingerprint": digest.hexdigest()},
                                  RESERVED_HEADER_BYTES))
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    return count
