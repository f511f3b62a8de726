"""Reading JSON files that come from outside (manifests, HF indexes and layouts) without
trusting them: bounded in size and depth, and no key given twice (with duplicates, which value
wins is up to the reader, so two readers could see two different files)."""

from __future__ import annotations

import json
from pathlib import Path

MAX_BYTES = 64 * 2**20  # a manifest of a large model is well under a megabyte
MAX_DEPTH = 64  # far deeper than any manifest or HF file nests


class JsonFileError(ValueError):
    """A JSON file that is too large, too deep, malformed or has a duplicate key; names the file."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise JsonFileError(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _depth(value: object) -> int:
    """Nesting depth, iteratively (a deep value must not exhaust the stack here either)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_bounded(path: str | Path, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of `path`, refusing (naming it) a file over `max_bytes` without reading it all."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JsonFileError(f"{path} is larger than {max_bytes:,} bytes, more than such a file ever holds")
    return data


def parse_json(data: bytes, source: str | Path):
    """The JSON value in `data` (read from `source`, which errors name): no duplicate key, at
    most MAX_DEPTH deep."""
    try:
        value = json.loads(data, object_pairs_hook=_no_duplicates)
    except JsonFileError as err:
        raise JsonFileError(f"{source} is not valid: {err}") from None
    except RecursionError:
        raise JsonFileError(f"{source} nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise JsonFileError(f"{source} is not valid JSON: {err}") from None
    if _depth(value) > MAX_DEPTH:
        raise JsonFileError(f"{source} nests deeper than {MAX_DEPTH} levels")
    return value


def load_json_file(path: str | Path, max_bytes: int = MAX_BYTES):
    """The JSON value in `path`; a JsonFileError naming the file when it is over `max_bytes`,
    nested deeper than MAX_DEPTH, not valid JSON or has a duplicate key."""
    return parse_json(read_bounded(path, max_bytes), path)
