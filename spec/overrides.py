"""Command-line overrides (`--set d_model=2048`, `--set block.attention.heads=16`) as .mspec text.

Each override is parsed as a statement of a model that extends the one named, so that resolution
and validation apply to it exactly as to a written spec. The model keeps its name: the original
is renamed out of the way and extended.
"""

from __future__ import annotations

import dataclasses
import re

from mxc.spec import ast
from mxc.spec.diagnostics import Diagnostic, Loc, SpecError
from mxc.spec.parser import parse

_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PREFIX = "--set "  # the path of an override's diagnostics: "--set d_model=2048"


def is_override(path: str) -> bool:
    return path.startswith(PREFIX)


def _statement(override: str) -> str:
    """The .mspec statement an override stands for. `block.F = V` sets field F of the unnamed
    block (`block x N { ... }`), `blocks.NAME.F = V` field F of block NAME."""
    target, _, value = override.partition("=")
    target, value = target.strip(), value.strip()
    if not _PATH.fullmatch(target) or not value:
        return ""
    parts = target.split(".")
    if parts[0] == "block" and len(parts) > 1:
        return f"block {{ {'.'.join(parts[1:])} = {value} }}"
    if parts[0] == "blocks" and len(parts) > 2:
        return f"block {parts[1]} {{ {'.'.join(parts[2:])} = {value} }}"
    return f"{target} = {value}"


def with_overrides(file: ast.File, name: str, overrides: list[str]) -> list[ast.File]:
    """`file` with model `name` renamed, and one file per override extending it under `name`
    (first, so that they are what `name` resolves to). A malformed override is a SpecError
    whose path is `--set OVERRIDE`."""
    hidden = f"{name} (before --set)"
    renamed = tuple(dataclasses.replace(item, name=hidden)
                    if isinstance(item, ast.Model) and item.name == name else item
                    for item in file.items)
    files, base = [], hidden
    for index, override in enumerate(overrides):
        statement = _statement(override)
        if not statement:
            raise SpecError([Diagnostic(Loc(PREFIX + override, 1, 1), "expected PATH=VALUE",
                                        "e.g. --set d_model=2048 or --set block.attention.heads=16")])
        own = name if index == len(overrides) - 1 else f"{name} (--set {index + 1})"
        # The model's name is no identifier: it is substituted after parsing.
        parsed = parse(f"model _ extends _ {{ {statement} }}", PREFIX + override)
        (model,) = parsed.items
        files.append(dataclasses.replace(parsed, items=(
            dataclasses.replace(model, name=own, extends=base),)))
        base = own
    return [*reversed(files), dataclasses.replace(file, items=renamed)]
