"""The language's own rules, checked where the text is: repeat counts, value types, overrides."""

import pytest

from mxc.spec import SpecError, load_text

BASE = """\
model m extends llama3-tiny {
%s
}
"""


def _error(body: str):
    text = BASE % body
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    return text, err.value.diagnostics


def _at(text: str, needle: str) -> tuple[int, int]:
    offset = text.index(needle)
    return text.count("\n", 0, offset) + 1, offset - text.rfind("\n", 0, offset)


@pytest.mark.parametrize("body, needle", [
    ("  layers = block x 0", "0"),
    ("  layers = (block x 3, block) x 0", "0"),
    ("  block x 0 {\n  }", "0"),
])
def test_a_repeat_count_of_zero_is_an_error_at_the_count(body, needle):
    text, diagnostics = _error(body)
    (diagnostic,) = diagnostics
    assert "repeat count must be at least 1" in diagnostic.message
    line, col = _at(text, needle)
    assert (diagnostic.loc.line, diagnostic.loc.col) == (line, text.split("\n")[line - 1].rindex(needle) + 1)
