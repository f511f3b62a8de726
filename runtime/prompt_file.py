"""Reading a prompt array (`--prompt-tokens`, `--tokens`): a .npy of int ids, shape (requests, length).

A `.bin` of `mxc tokenize` is one stream of documents with no rows, so it is refused by name rather
than guessed into prompts; numpy would otherwise answer with its message about pickled data."""

from __future__ import annotations

import numpy as np

from mxc.runtime.token_file import MAGIC

NPY_MAGIC = b"\x93NUMPY"
ACCEPTED = "a .npy array of int token ids, shape (requests, length) (e.g. np.save('p.npy', ids))"


class PromptFileError(ValueError):
    """The prompt file cannot be read as a prompt array."""


def read_prompt_array(path: str, flag: str) -> np.ndarray:
    """The array in `path`, loaded without pickle; an error names the file, the flag and the format."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as err:
        raise PromptFileError(f"cannot read {flag} {path}: {err.strerror or err}") from None
    if head.startswith(MAGIC):
        raise PromptFileError(f"{flag} {path} is a token file of mxc tokenize (a stream of documents for "
                              f"mxc run --data); {flag} takes {ACCEPTED}")
    if not head.startswith(NPY_MAGIC):
        raise PromptFileError(f"{flag} {path} is not a .npy file; {flag} takes {ACCEPTED}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise PromptFileError(f"cannot read {flag} {path}: {err}; {flag} takes {ACCEPTED}") from None
