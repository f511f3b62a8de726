"""Shared by the spec tests: a value written on one line of a model is refused at that line."""

from __future__ import annotations

import pytest

from mxc.spec import SpecError, load_text


def assert_refused_where_written(text: str, line: str, needle: str, message: str) -> None:
    """Loading `text` fails with a diagnostic containing `message` located where `needle` stands on `line`."""
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    found = [d for d in err.value.diagnostics if message in d.message + (d.hint or "")]
    assert found, [d.message for d in err.value.diagnostics]
    row = text.count("\n", 0, text.index(line)) + 1
    col = text.split("\n")[row - 1].index(needle) + 1
    assert (found[0].loc.line, found[0].loc.col) == (row, col)
