"""The mode a file mxc writes ends up with: what the user's umask gives any new file.

Files that must appear whole are staged with `tempfile.mkstemp` and renamed into place; mkstemp
creates them 0600, private to the owner, which would make a token file or a metrics file unlike
every other file the user writes. Staged files are given the ordinary mode before the rename.
"""

from __future__ import annotations

import os


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode `open(path, "w")` would give a new file: 0666 less the umask (0644 under 022)."""
    return 0o666 & ~current_umask()


def give_new_file_mode(descriptor: int) -> None:
    """Gives an open staged file (from mkstemp) the mode of a newly created file."""
    os.fchmod(descriptor, new_file_mode())
