"""File names read from an index, a layout or a manifest: each must be a plain name inside its
folder, so that a crafted file cannot make mxc read or write outside that folder."""

from __future__ import annotations

import os
from pathlib import Path


def plain_name(name: object, source: str) -> str:
    """`name` when it is one plain relative file name (no separator, not '.' or '..', not
    absolute); otherwise a ValueError naming `source`, the file that held it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name) or Path(name).name != name:
        raise ValueError(f"{source}: {name!r} is not a plain file name inside its folder")
    return name


def inside(path: Path, folders: list[Path]) -> bool:
    """Whether `path`, with every symlink resolved, lies inside one of `folders` (also resolved)."""
    target = path.resolve()
    return any(target.is_relative_to(folder.resolve()) for folder in folders)
