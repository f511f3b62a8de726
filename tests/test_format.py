"""The formatter: canonical, idempotent, keeps every comment, and never changes what a file means."""

import dataclasses
import re
from pathlib import Path
from collections import Counter
from importlib import resources

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxc.spec.diagnostics import Loc, SpecError
from mxc.spec.format import format_text
from mxc.spec.load import load_text
from mxc.spec.parser import parse


def _ir(text: str, path: str) -> dict:
    return {name: spec.model_dump() for name, spec in load_text(text, path).items()}


def _comments(text: str) -> Counter:
    return Counter(c.text for c in parse(text).comments)


_POSITIONS = {"loc", "start_line", "open_line", "end_line"}


def _shape(node):
    """A syntax tree without positions: what was written, not where."""
    if isinstance(node, (tuple, list)):
        return tuple(_shape(n) for n in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, Loc):
        return (type(node).__name__,) + tuple(
            (f.name, _shape(getattr(node, f.name))) for f in dataclasses.fields(node)
            if f.name not in _POSITIONS and not f.name.endswith(("_loc", "_locs")))
    return node


def _assert_formats_faithfully(text: str) -> str:
    formatted = format_text(text)
    assert format_text(formatted) == formatted
    assert _comments(formatted) == _comments(text)
    assert _shape(parse(formatted).items) == _shape(parse(text).items)
    return formatted


# ------------------------------------------------------------------ the zoo


def _zoo_files():
    return sorted((e for e in resources.files("mxc.models").iterdir() if e.name.endswith(".mspec")),
                  key=lambda e: e.name)


def test_the_zoo_has_files():
    assert "llama.mspec" in [e.name for e in _zoo_files()]


@pytest.mark.parametrize("entry", _zoo_files(), ids=lambda e: e.name)
def test_zoo_file_formats_idempotently_to_the_same_models(entry):
    text = entry.read_text()
    formatted = _assert_formats_faithfully(text)
    assert _ir(formatted, f"<formatted>/{entry.name}") == _ir(text, f"<original>/{entry.name}")


# ------------------------------------------------------------------ layout

LLAMA = """\
model llama3.1-8b {
  vocab = 128256
  d_model = 4096
  max_seq = 131072
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = bfloat16
  block x 32 {
    attention = gqa(heads = 32, kv_heads = 8, head_dim = 128,
                    rope = rope(theta = 500000,
                                scaling = llama3(factor = 8, low_freq = 1, high_freq = 4,
                                                 original_max_seq = 8192)))
    mlp = glu(hidden = 14336, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
"""


def test_canonical_text_is_a_fixed_point():
    assert format_text(LLAMA) == LLAMA


def test_any_spacing_gives_the_canonical_text():
    squashed = " ".join(LLAMA.split())
    assert format_text(squashed) == LLAMA
    # Single newlines anywhere: no blank line, so nothing to keep.
    stretched = squashed.replace(" ", "\n\t").replace("(", "\n(\n").replace("=", " \n= ")
    assert format_text(stretched) == LLAMA


def test_one_line_call_wraps_greedily_with_hanging_indent():
    flat = ("model m {\n  block x 1 {\n    attention = gqa(heads = 32, kv_heads = 8, head_dim = 128, "
            "rope = rope(theta = 500000, scaling = llama3(factor = 8, low_freq = 1, high_freq = 4, "
            "original_max_seq = 8192)))\n  }\n}\n")
    wrapped = format_text(flat)
    assert wrapped.splitlines()[2:6] == LLAMA.splitlines()[9:13]


def test_line_of_exactly_the_width_stays_and_one_more_wraps():
    def line(digits):
        return f"let a = f(b = {'1' * digits}, c = 2)"
    fits = line(100 - len(line(0)))
    assert len(fits) == 100
    assert format_text(fits) == fits + "\n"
    too_long = line(101 - len(line(0)))
    assert format_text(too_long) == f"let a = f(b = {'1' * (101 - len(line(0)))},\n          c = 2)\n"


def test_item_after_a_wrapped_item_starts_its_own_line():
    text = ("let a = outer(inner = g(x1 = 111111111, x2 = 222222222, x3 = 333333333, x4 = 444444444, "
            "x5 = 555555555), after = 1)")
    assert format_text(text) == (
        "let a = outer(inner = g(x1 = 111111111, x2 = 222222222, x3 = 333333333, x4 = 444444444,\n"
        "                        x5 = 555555555),\n"
        "              after = 1)\n")


def test_lists_wrap_like_calls():
    items = ", ".join(str(10**9 + i) for i in range(12))
    out = format_text(f"let sizes = [{items}]")
    lines = out.splitlines()
    assert lines[0].startswith("let sizes = [1000000000, ")
    assert all(line.startswith(" " * len("let sizes = [")) for line in lines[1:])
    assert all(len(line) <= 100 for line in lines) and lines[-1].endswith("]")
    assert format_text("let e = [ ]\nlet one = [\n 1 ,2]") == "let e = []\n\nlet one = [1, 2]\n"


def test_long_layers_wrap_after_a_comma():
    segments = ", ".join(f"(local_{i} x 5, global_{i}) x 4" for i in range(5))
    out = format_text(f"model m {{ layers = {segments} }}")
    lines = out.splitlines()[1:-1]
    assert lines[0].startswith("  layers = (local_0 x 5, global_0) x 4, ")
    assert all(line.startswith(" " * len("  layers = ")) for line in lines[1:])
    assert all(len(line) <= 100 for line in lines)
    assert " ".join(" ".join(lines).split()) == f"layers = {segments}"


def test_statements_and_headers():
    text = """model  a  extends  b{block local{}block{ }block  x  2 {a.b.c=1  d=x}
    shard{batch->(data,fsdp)embed->fsdp heads->(tensor)mlp->()}mesh{tensor=4 data=2}
    layers=(local x 5,global)x 4,local x 2 let k=[1,2]}"""
    assert format_text(text) == """\
model a extends b {
  block local {}
  block {}
  block x 2 {
    a.b.c = 1
    d = x
  }
  shard {
    batch -> (data, fsdp)
    embed -> fsdp
    heads -> (tensor)
    mlp -> ()
  }
  mesh {
    tensor = 4
    data = 2
  }
  layers = (local x 5, global) x 4, local x 2
  let k = [1, 2]
}
"""


def test_literals_keep_their_text():
    text = 'let a = f(x = 1e-5, y = 10_000, z = .5, w = 2.50, v = -3, u = - 1E+3, s = "q\\"#", t = true)'
    assert format_text(text) == (
        'let a = f(x = 1e-5, y = 10_000, z = .5, w = 2.50, v = -3, u = -1E+3, s = "q\\"#", t = true)\n')


def test_blank_lines():
    text = "\n\n\nlet a = 1\nlet b = 2\n\n\n\nmodel m {\n\n\n  x = 1\n  y = 2\n\n\n\n  z = 3\n\n}\n\n\n"
    assert format_text(text) == "let a = 1\n\nlet b = 2\n\nmodel m {\n  x = 1\n  y = 2\n\n  z = 3\n}\n"


def test_empty_file():
    assert format_text("") == ""
    assert format_text("\n  \n") == ""


def test_syntax_error_raises_spec_error():
    with pytest.raises(SpecError) as err:
        format_text("model m {\n  d_model = \n}\n", "bad.mspec")
    assert err.value.diagnostics[0].loc.path == "bad.mspec"
    with pytest.raises(SpecError):
        format_text("model m { block x { } }")
    with pytest.raises(SpecError):
        format_text("model m {")


# ------------------------------------------------------------------ comments


@pytest.mark.parametrize("source, expected", [
    pytest.param("# head\n\n# two\nmodel m {}\n", "# head\n\n# two\nmodel m {}\n", id="start of file"),
    pytest.param("model m {}\n# tail\n\n# last", "model m {}\n# tail\n\n# last\n", id="end of file"),
    pytest.param("model m {}\n# about n\nmodel n {}", "model m {}\n\n# about n\nmodel n {}\n",
                 id="between items"),
    pytest.param("model m {\n  x = 1\n    # about y\n  y = 2\n}",
                 "model m {\n  x = 1\n  # about y\n  y = 2\n}\n",
                 id="own line before a statement, reindented"),
    pytest.param("model m { x = 1   # one\n y = 2 }", "model m {\n  x = 1  # one\n  y = 2\n}\n",
                 id="trailing"),
    pytest.param("model m {\n  x = f(a = 1,  # inside\n        b = 2)  # last\n}",
                 "model m {\n  # inside\n  x = f(a = 1, b = 2)  # last\n}\n",
                 id="inside a multi-line statement moves before it"),
    pytest.param("model m {\n  x = 1\n\n  # closing\n}", "model m {\n  x = 1\n\n  # closing\n}\n",
                 id="before a closing brace"),
    pytest.param("model m {  # opening\n  x = 1\n}", "model m {  # opening\n  x = 1\n}\n",
                 id="after an opening brace"),
    pytest.param("model m # name\n extends n\n{\n}", "# name\nmodel m extends n {}\n",
                 id="inside a header"),
    pytest.param("model m { block x 2 { a = 1 } # brace\n}",
                 "model m {\n  block x 2 {\n    a = 1\n  }  # brace\n}\n", id="after a closing brace"),
    pytest.param("model m { block x 2 { # open\n} }", "model m {\n  block x 2 {  # open\n  }\n}\n",
                 id="in an empty block"),
    pytest.param("model m { block x 2 { # open\n} # close\n}",
                 "model m {\n  block x 2 {  # open\n  }  # close\n}\n",
                 id="both braces of an empty block"),
    pytest.param("model m {\n  shard { batch -> (data, # why\n fsdp) }\n}",
                 "model m {\n  shard {\n    # why\n    batch -> (data, fsdp)\n  }\n}\n",
                 id="inside a rule"),
    pytest.param("model m {\n  layers = a x 2, # why\n  b\n}",
                 "model m {\n  # why\n  layers = a x 2, b\n}\n",
                 id="inside layers"),
    pytest.param("model m {\n  a = 1 b = 2 # b's\n}", "model m {\n  a = 1\n  b = 2  # b's\n}\n",
                 id="two statements on a line: the last owns it"),
    pytest.param('let s = "# not a comment" # a comment', 'let s = "# not a comment"  # a comment\n',
                 id="hash in a string"),
    pytest.param("# only a comment", "# only a comment\n", id="nothing but a comment"),
])
def test_comment_positions(source, expected):
    assert format_text(source) == expected
    assert format_text(expected) == expected
    assert _comments(expected) == _comments(source)


def test_line_ends_are_counted_as_the_lexer_counts_them():
    # "\r\n" ends a line; a form feed inside a comment does not (str.splitlines would split there).
    text = "# a\r\nmodel m {\r\n  x = 1  # b\x0c c\r\n\r\n  y = 2  # d\r\n}\r\n"
    assert format_text(text) == "# a\nmodel m {\n  x = 1  # b\x0c c\n\n  y = 2  # d\n}\n"


def test_trailing_comment_goes_after_the_last_wrapped_line():
    text = LLAMA.replace("original_max_seq = 8192)))", "original_max_seq = 8192)))  # scaled")
    assert format_text(text.replace(",\n", ", ")) == text


# ------------------------------------------------------------------ generated specs

_AXES_LOGICAL = ("batch", "seq", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp")
_AXES_MESH = ("data", "fsdp", "tensor", "expert", "context", "stage")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\d[\d_]*(?:\.[\d_]*)?(?:[eE][+-]?\d+)?'
                    r"|[A-Za-z_]\w*(?:[.\-]\w+)*|->|\S")


@st.composite
def _number(draw, values):
    """An integer written in one of the ways the language allows (256.0 is no integer)."""
    value = draw(st.sampled_from(values))
    if draw(st.booleans()) and value >= 1000:
        return f"{value:_}"
    return str(value)


@st.composite
def _block_body(draw) -> str:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    theta = draw(st.sampled_from(["10000", "1e4", "10_000", "500000.0"]))
    rope = f"rope(theta = {theta})"
    if draw(st.booleans()):
        rope = (f"rope(theta = {theta}, scaling = llama3(factor = 8, low_freq = 1, high_freq = 4, "
                f"original_max_seq = {draw(_number([8192, 4096]))}))")
    if draw(st.booleans()):
        attention = f"gqa(heads = {heads}, kv_heads = {kv_heads}, head_dim = {head_dim}, rope = {rope})"
    else:
        attention = f"mha(heads = {heads}, head_dim = {head_dim}, rope = {rope})"
    mlp = f"glu(hidden = {draw(st.integers(1, 4096))}, act = {draw(st.sampled_from(['silu', 'gelu']))})"
    return f"attention = {attention} mlp = {mlp} norm = rmsnorm(eps = eps)"


@st.composite
def _shard(draw) -> str:
    rules = []
    for logical in draw(st.lists(st.sampled_from(_AXES_LOGICAL), unique=True, max_size=4)):
        axes = draw(st.lists(st.sampled_from(_AXES_MESH), unique=True, max_size=3))
        bare = len(axes) == 1 and draw(st.booleans())
        rules.append(f"{logical} -> " + (axes[0] if bare else f"({', '.join(axes)})"))
    return "shard { " + " ".join(rules) + " }"


@st.composite
def _mesh(draw) -> str:
    axes = draw(st.lists(st.sampled_from(_AXES_MESH), unique=True, max_size=3))
    return "mesh { " + " ".join(f"{a} = {draw(st.integers(1, 16))}" for a in axes) + " }"


@st.composite
def _spec(draw) -> str:
    """A file with a valid dense model, maybe a child of it, and `let` constants, spaced by one."""
    items = [f"let eps = {draw(st.sampled_from(['1e-5', '1e-6', '0.00001']))}"]
    if draw(st.booleans()):
        items.append('let note = "a # b \\" c"')
    if draw(st.booleans()):
        items.append("let shift = -1")
    body = draw(st.permutations([
        f"vocab = {draw(_number([256, 512, 32000]))}",
        f"d_model = {draw(_number([64, 128, 4096]))}",
        f"max_seq = {draw(_number([256, 8192]))}",
        f"embedding = embedding(tied = {draw(st.sampled_from(['true', 'false']))})",
        "final_norm = rmsnorm(eps = eps)"]))
    named = draw(st.booleans())
    if named:
        body += [f"block {name} {{ {draw(_block_body())} }}" for name in ("local", "global")]
        body.append("layers = " + draw(st.sampled_from([
            "(local x 2, global) x 3", "local, global",
            "((local, global) x 2, local) x 2, global x 4"])))
    else:
        body.append(f"block x {draw(st.integers(1, 64))} {{ {draw(_block_body())} }}")
    if draw(st.booleans()):
        body.append(draw(_shard()))
    if draw(st.booleans()):
        body.append(draw(_mesh()))
    # A zoo parent's anonymous block would go unused beside named ones.
    parent = " extends llama3-tiny" if not named and draw(st.booleans()) else ""
    items.append(f"model hyp-base{parent} {{ {' '.join(body)} }}")
    if draw(st.booleans()):
        block = "block local" if named else f"block x {draw(st.integers(1, 8))}"
        items.append(f"model hyp.child-1 extends hyp-base {{ d_model = 256 "
                     f"{block} {{ mlp.hidden = {draw(st.integers(1, 512))} }} }}")
    return " ".join(draw(st.permutations(items)))


_COMMENT_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"),
                        max_size=20)
_SPACES = [" ", " ", " ", " ", "\n", "\n\n", "\n\n\n", "\t", "  \n  "]


@st.composite
def _source(draw):
    """A generated spec with random spacing between tokens and random comments; and its comments."""
    text, comments = [], []
    for token in ["", *_TOKEN.findall(draw(_spec()))]:
        text.append(token)
        gap = draw(st.integers(0, len(_SPACES) + 1))
        if gap < len(_SPACES):
            text.append(_SPACES[gap])
        else:
            comment = ("#" + draw(_COMMENT_TEXT)).rstrip()
            comments.append(comment)
            text.append((" " if gap == len(_SPACES) else "\n") + comment + "\n")
    return "".join(text), comments


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_source())
def test_generated_specs_format_faithfully(source):
    text, comments = source
    assert _comments(text) == Counter(comments)  # the generator wrote what it meant to
    formatted = _assert_formats_faithfully(text)
    assert _comments(formatted) == Counter(comments)
    assert _ir(formatted, "<formatted>") == _ir(text, "<original>")
    for line in formatted.split("\n"):
        assert line == line.rstrip()
        assert len(line) <= 100 or "#" in line


def test_fmt_diff_prints_a_unified_diff_and_writes_nothing(tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "m.mspec"
    messy = "model m extends llama3-tiny {\n  vocab=1024\n}\n"
    path.write_text(messy)
    mxc = Path(sys.executable).with_name("mxc")
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    result = subprocess.run([str(mxc), "fmt", "--diff", str(path)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stdout == (f"--- {path}\n+++ {path} (formatted)\n@@ -1,3 +1,3 @@\n"
                             " model m extends llama3-tiny {\n-  vocab=1024\n+  vocab = 1024\n }\n")
    assert path.read_text() == messy
    path.write_text(format_text(messy, str(path)))
    clean = subprocess.run([str(mxc), "fmt", "--diff", str(path)], capture_output=True, text=True,
                           env=env, timeout=120)
    assert (clean.returncode, clean.stdout) == (0, "")
