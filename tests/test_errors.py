"""Broken specs give located diagnostics through `mxc check`: exit 1, `file:line:col: error: ...`,
the source line with a caret under the column, never a traceback.

Each case mutates one valid spec; the expected place is found in the mutated text itself.
"""

import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxc.spec import load_text
from mxc.spec.diagnostics import SpecError

MXC = Path(sys.executable).with_name("mxc")
HEADER = re.compile(r"^(\S+):(\d+):(\d+): error: (.*)$")

VALID = """\
model tiny {
  vocab = 512
  d_model = 64
  max_seq = 256
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  block x 2 {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 16, rope = rope(theta = 10000))
    mlp = glu(hidden = 128, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  shard { batch -> (data, fsdp)  embed -> fsdp  heads -> tensor }
}
"""

MOE = ("moe(experts = 8, top_k = 2, expert = glu(hidden = 64, act = silu), "
       "router = router(score = softmax, normalize = true))")
MLA = ("mla(heads = 4, q_lora_rank = none, kv_lora_rank = 32, qk_nope_head_dim = 16, "
       "qk_rope_head_dim = 8, v_head_dim = 16, lora_norm = rmsnorm(eps = 1e-6), "
       "rope = rope(theta = 10000))")
GQA = "gqa(heads = 4, kv_heads = 2, head_dim = 16, rope = rope(theta = 10000))"
TWO_BLOCKS = VALID.replace("  block x 2 {", "  layers = local x 2, global\n  block local {").replace(
    "  shard {", "  block global {\n    attention = " + GQA + "\n    mlp = glu(hidden = 128, act = silu)\n"
    "    norm = rmsnorm(eps = 1e-5)\n  }\n  shard {")


@dataclass
class Shown:
    """One rendered diagnostic."""

    path: str
    line: int
    col: int
    message: str
    source: str | None  # the source line as shown
    caret: int | None  # 1-based column of the '^'
    hint: str | None


def parse_stderr(stderr: str) -> list[Shown]:
    shown, lines, i = [], stderr.splitlines(), 0
    while i < len(lines):
        match = HEADER.match(lines[i])
        assert match, f"not a diagnostic header: {lines[i]!r} in\n{stderr}"
        item = Shown(match[1], int(match[2]), int(match[3]), match[4], None, None, None)
        i += 1
        if i + 1 < len(lines) and lines[i + 1].lstrip().startswith("^"):
            item.source = lines[i][2:]
            item.caret = lines[i + 1].index("^") - 2 + 1
            i += 2
        if i < len(lines) and lines[i].startswith("  hint: "):
            item.hint = lines[i][len("  hint: "):]
            i += 1
        shown.append(item)
    return shown


def run_check(path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MXC_DEBUG"}
    return subprocess.run([str(MXC), "check", str(path)], capture_output=True, text=True,
                          env=env, timeout=120)


def where(text: str, needle: str, after: str = "") -> tuple[int, int]:
    """(line, col) of `needle`, at its first occurrence after the first `after`."""
    start = text.index(after) + len(after) if after else 0
    offset = text.index(needle, start)
    return text.count("\n", 0, offset) + 1, offset - text.rfind("\n", 0, offset)


def end_of_text(text: str) -> tuple[int, int]:
    """(line, col) just after the last character that is not blank."""
    body = text.rstrip()
    return body.count("\n") + 1, len(body) - body.rfind("\n")


# (id, mutated text, message, place as (needle, after) or "eof", hint or None)
CASES = [
    ("closing-brace-at-end", VALID.rstrip()[:-1], "unexpected end of file", "eof",
     "the '{' on line 1, column 12 is never closed"),
    ("closing-brace-before-next-model", VALID.rstrip()[:-1] + "\n" + VALID.replace("tiny", "tiny2"),
     "'model' cannot appear here", ("model tiny2", ""), "is a '}' missing before it?"),
    ("closing-brace-of-block", TWO_BLOCKS.replace("norm = rmsnorm(eps = 1e-5)\n  }\n  block global",
                                                  "norm = rmsnorm(eps = 1e-5)\n  block global"),
     "'block' cannot appear here", ("block global", ""), "The '{' on line 8, column 15 is still open"),
    ("misspelled-field", VALID.replace("vocab =", "vocabb ="), "unknown field 'vocabb'",
     ("vocabb", ""), "did you mean 'vocab'?"),
    ("misspelled-argument", VALID.replace("kv_heads = 2", "kv_head = 2"),
     "unknown field 'kv_head' in gqa(...)", ("kv_head", ""), "did you mean 'kv_heads'?"),
    ("heads-not-divisible", VALID.replace("kv_heads = 2", "kv_heads = 3"),
     "heads (4) is not divisible by kv_heads (3)", ("kv_heads", ""), None),
    ("truncated-mid-word", VALID[:VALID.index("kv_heads") + 4], "unexpected end of file", "eof",
     "never closed"),
    ("unknown-kind", VALID.replace("gqa(", "gqaa("), "unknown kind 'gqaa'", ("gqaa", ""),
     "did you mean 'gqa'?"),
    ("unknown-logical-axis", VALID.replace("embed -> fsdp", "embedding -> fsdp"),
     "unknown logical axis 'embedding'", ("embedding ->", ""), "did you mean 'embed'?"),
    ("unknown-mesh-axis", VALID.replace("heads -> tensor", "heads -> tensr"),
     "unknown mesh axis 'tensr'", ("tensr", ""), "did you mean 'tensor'?"),
    ("top-k-above-experts", VALID.replace("glu(hidden = 128, act = silu)", MOE).replace("top_k = 2", "top_k = 9"),
     "top_k (9) is larger than experts (8)", ("top_k", ""), None),
    ("window-on-mla", VALID.replace(GQA, MLA[:-1] + ", window = 64)"),
     "mla attention has no window", ("window", ""), None),
    ("extends-cycle", VALID.replace("model tiny {", "model tiny extends tiny {"),
     "'extends' cycle: tiny -> tiny", ("tiny", "extends"), None),
    ("duplicate-key", VALID.replace("  d_model = 64", "  d_model = 64\n  d_model = 128"),
     "duplicate key 'd_model'", ("d_model", "d_model = 64\n"), "first set on line 3"),
    ("duplicate-argument", VALID.replace("head_dim = 16", "head_dim = 16, head_dim = 32"),
     "duplicate key 'head_dim' in gqa(...)", ("head_dim", "head_dim = 16,"), None),
    ("zero-heads", VALID.replace("(heads = 4", "(heads = 0"), "greater than 0 (got 0)", ("heads", "gqa("), None),
    ("negative-size", VALID.replace("vocab = 512", "vocab = -512"), "greater than 0 (got -512)",
     ("vocab", ""), None),
    ("string-heads", VALID.replace("(heads = 4", '(heads = "x"'), 'must be an integer, not the string "x"',
     ("heads", "gqa("), None),
    ("float-hidden", VALID.replace("hidden = 128", "hidden = 1.5"), "must be an integer, not 1.5",
     ("hidden", ""), None),
    ("unknown-block-in-layers", TWO_BLOCKS.replace("local x 2, global", "local x 2, globl"),
     "unknown block 'globl' in layers", ("globl", ""), "did you mean 'global'?"),
    ("unknown-enum", VALID.replace("act = silu", "act = swish"), "must be one of", ("act", ""), None),
    ("unknown-parent", VALID.replace("model tiny {", "model tiny extends llama3.1-8c {"),
     "unknown model 'llama3.1-8c'", ("llama3.1-8c", ""), "did you mean 'llama3.1-8b'?"),
]


EVERY_ERROR = (VALID.replace("vocab =", "vocabb =")
               .replace("(heads = 4", "(heads = 0")
               .replace("act = silu", "act = silux")
               .replace("embed -> fsdp", "embedd -> fsdp"))
SEVERAL_MODELS = (VALID.replace("d_model = 64", "d_model = 0") + "\n"
                  + VALID.replace("model tiny {", "model other extends tiny {").replace("kv_heads = 2", "kv_heads = 3"))
NOT_UTF8 = VALID.encode().replace(b"d_model", b"d_mo\xffdel")
GARBAGE_INSIDE = VALID.replace("  max_seq = 256", "  max_seq = 256 }{ @@ ]")


def _garbage_text(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = "{}()[]=,.-\"#\n\t\x0c abcxyz0123456789_;:@$\x00\x1b\u00e9\u2028"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))


def _garbage_bytes(seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))


SUBJECTS = {name: text for name, text, *_ in CASES} | {
    "every-error": EVERY_ERROR, "several-models": SEVERAL_MODELS, "not-utf8": NOT_UTF8,
    "garbage-inside": GARBAGE_INSIDE,
    **{f"garbage-text-{seed}": _garbage_text(seed) for seed in range(4)},
    **{f"garbage-bytes-{seed}": _garbage_bytes(seed) for seed in range(2)},
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    """`mxc check` on every subject, one process each; a few at a time, as a process mostly
    waits on its own start-up."""
    folder = tmp_path_factory.mktemp("specs")
    paths = {}
    for name, text in SUBJECTS.items():
        paths[name] = folder / f"{name}.mspec"
        if isinstance(text, bytes):
            paths[name].write_bytes(text)
        else:
            paths[name].write_text(text)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(paths, pool.map(run_check, paths.values())))
    return {name: (paths[name], results[name]) for name in paths}


def check_file(checked: dict, name: str) -> list[Shown]:
    """What every diagnostic must satisfy: exit 1, no traceback, a header, the caret under the
    reported column of the real source line."""
    path, result = checked[name]
    text = SUBJECTS[name]
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert HEADER.match(result.stderr.splitlines()[0])
    shown = parse_stderr(result.stderr)
    source_lines = text.split("\n")
    for item in shown:
        assert item.path == str(path)
        if item.source is not None:
            expected = source_lines[item.line - 1].expandtabs(1)
            expected = "".join(c if c.isprintable() else "\ufffd" for c in expected)
            assert item.source == expected
            assert item.caret == item.col
    return shown


@pytest.mark.parametrize("name, text, message, place, hint", CASES, ids=[c[0] for c in CASES])
def test_broken_spec(checked, name, text, message, place, hint):
    assert text != VALID
    shown = check_file(checked, name)
    first = shown[0]
    assert message in first.message
    line, col = end_of_text(text) if place == "eof" else where(text, *place)
    assert (first.line, first.col) == (line, col)
    assert first.source is not None
    if hint is not None:
        assert hint in (first.hint or "")


def test_every_error_in_a_file_is_reported(checked):
    shown = check_file(checked, "every-error")
    text = EVERY_ERROR
    got = [(s.line, s.col, s.message) for s in shown]
    assert [(line, col) for line, col, _ in got] == [
        where(text, "vocabb"), where(text, "heads", "gqa("), where(text, "act"), where(text, "embedd", "shard")]
    assert "unknown field 'vocabb'" in got[0][2]
    assert "greater than 0" in got[1][2]
    assert "'silu'" in got[2][2]
    assert "unknown logical axis 'embedd'" in got[3][2]
    # The misspelt field explains the missing one: no second error for `vocab`.
    assert not any("missing field 'vocab'" in s.message for s in shown)


def test_errors_in_several_models_are_all_reported(checked):
    shown = check_file(checked, "several-models")
    text = SEVERAL_MODELS
    assert [(s.line, s.col) for s in shown] == [where(text, "d_model"), where(text, "kv_heads", "model other")]


def test_not_utf8(checked):
    shown = check_file(checked, "not-utf8")
    assert shown[0].message == "not UTF-8 text: byte 0xff"
    assert (shown[0].line, shown[0].col) == (3, 7)


@pytest.mark.parametrize("name", [n for n in SUBJECTS if n.startswith("garbage-")])
def test_random_garbage(checked, name):
    check_file(checked, name)


def test_garbage_inside_a_valid_spec(checked):
    shown = check_file(checked, "garbage-inside")
    # The '}' closes the model early; the '{' after it is what cannot stand at the top level.
    assert (shown[0].line, shown[0].col) == where(GARBAGE_INSIDE, "{ @@")


# In-process, many more mutations: nothing but a SpecError, and every diagnostic located.
_PIECES = ["{", "}", "(", ")", "=", ",", ".", "-", "x", '"', "#", "\n", " ", "model", "block", "extends",
           "layers", "shard", "->", "none", "0", "-1", "1e-5", "heads", "gqa", "moe", "tiny", "\x0c"]


@st.composite
def mutated(draw):
    text = VALID
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["delete", "insert", "truncate"]))
        if action == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 12)):]
        elif action == "insert":
            text = text[:at] + draw(st.sampled_from(_PIECES)) + text[at:]
        else:
            text = text[:at]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_only_raise_located_spec_errors(text):
    try:
        load_text(text, "m.mspec")
    except SpecError as err:
        assert err.diagnostics
        line_count = text.count("\n") + 1
        for diagnostic in err.diagnostics:
            if diagnostic.loc.path == "m.mspec":
                assert 1 <= diagnostic.loc.line <= line_count
                assert diagnostic.loc.col >= 1
        for line in err.render().splitlines():
            assert not line.startswith("m.mspec") or HEADER.match(line)
