"""editors/: the TextMate grammar and the VS Code problem matcher are valid and cover the language."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EDITORS = ROOT / "editors"


def _grammar() -> dict:
    return json.loads((EDITORS / "mspec.tmLanguage.json").read_text())


def _regexes(node):
    """Every match/begin/end regex in the grammar (Oniguruma; Python's re reads this subset)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("match", "begin", "end", "regexp"):
                yield value
            else:
                yield from _regexes(value)
    elif isinstance(node, list):
        for item in node:
            yield from _regexes(item)


def test_the_grammar_is_json_whose_regexes_compile():
    grammar = _grammar()
    assert grammar["scopeName"] == "source.mspec" and grammar["fileTypes"] == ["mspec"]
    regexes = list(_regexes(grammar))
    assert len(regexes) >= 10
    for regex in regexes:
        re.compile(regex)
    for pattern in grammar["patterns"]:  # every include names a rule that exists
        assert pattern["include"].lstrip("#") in grammar["repository"]


def _code(text: str) -> str:
    """Text without comments and strings, where keywords are keywords."""
    return re.sub(r'#[^\n]*|"([^"\\\n]|\\.)*"', " ", text)


def test_the_keyword_rule_matches_the_languages_keywords():
    keyword = re.compile(_grammar()["repository"]["keyword"]["match"])
    lark = (ROOT / "spec" / "mspec.lark").read_text()
    words = set(re.findall(r'"([a-z]{2,})"', re.sub(r"//[^\n]*", "", lark)))
    assert words == {"model", "extends", "block", "let", "layers", "shard", "mesh"}
    assert {m[0] for m in keyword.finditer(" ".join(sorted(words)))} == words
    assert not keyword.search("blocks modelled layer meshes")  # whole words only


@pytest.mark.parametrize("path", sorted((ROOT / "models").glob("*.mspec")), ids=lambda p: p.name)
def test_every_keyword_in_the_zoo_is_highlighted(path):
    keyword = re.compile(_grammar()["repository"]["keyword"]["match"])
    code = _code(path.read_text())
    statement_starts = re.findall(r"(?m)^\s*(model|block|let|layers|shard|mesh)\b", code)
    assert statement_starts
    starts = [m.start(1) for m in re.finditer(r"(?m)^\s*(model|block|let|layers|shard|mesh)\b", code)]
    starts += [m.start() for m in re.finditer(r"\bextends\b", code)]
    found = {m.start() for m in keyword.finditer(code)}
    assert set(starts) <= found


def test_the_problem_matcher_reads_mxc_diagnostics(tmp_path):
    import os

    matcher = json.loads((EDITORS / "mspec-problem-matcher.json").read_text())
    (pattern,) = matcher["pattern"]
    path = tmp_path / "bad.mspec"
    path.write_text("model m extends llama3-tiny {\n  vocabb = 5\n}\n")
    mxc = Path(sys.executable).with_name("mxc")
    result = subprocess.run([str(mxc), "check", str(path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    matches = [m for m in map(re.compile(pattern["regexp"]).match, result.stderr.splitlines()) if m]
    assert len(matches) == 1, result.stderr
    (match,) = matches
    assert (match[pattern["file"]], match[pattern["line"]], match[pattern["column"]],
            match[pattern["severity"]], match[pattern["message"]]) == (
        str(path), "2", "3", "error", "unknown field 'vocabb'")
