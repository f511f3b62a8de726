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


def _mxc(*args: str):
    import os
    import subprocess
    import sys
    from pathlib import Path

    mxc = Path(sys.executable).with_name("mxc")
    return subprocess.run([str(mxc), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})


def test_check_json_reports_diagnostics_on_stdout(tmp_path):
    import json

    path = tmp_path / "bad.mspec"
    path.write_text(BASE % "  vocabb = 5")
    result = _mxc("check", "--json", str(path))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["models"] == []
    assert report["diagnostics"] == [{
        "file": str(path), "line": 2, "column": 3, "end_line": 2, "end_column": 9,
        "severity": "error", "message": "unknown field 'vocabb'", "hint": "did you mean 'vocab'?"}]


def test_check_refuses_a_seq_beyond_max_seq():
    result = _mxc("check", "llama3-tiny", "--seq", "257")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "mxc: error: --seq 257 is longer than llama3-tiny's max_seq (256)"
    assert _mxc("check", "llama3-tiny", "--seq", "256").returncode == 0


@pytest.mark.parametrize("line, field, message", [
    ("attention.qk_norm = rmsnorm(eps = 1e-6)", "qk_norm", "mla attention takes no qk_norm"),
    ("attention.temperature_tuning = temperature_tuning(floor_scale = 8192, attn_scale = 0.1)", "temperature_tuning",
     "mla attention takes no temperature_tuning"),
    ("mlp.shared_experts = 2\n    mlp.expert.bias = true", "shared_experts", "2 shared experts with biases"),
])
def test_rules_lowering_relied_on_are_located_validation_errors(line, field, message):
    text = f"model m extends mla-tiny {{\n  block moe {{\n    {line}\n  }}\n}}\n"
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    # (temperature tuning on a rope layer is a second error there, about NoPE)
    (diagnostic,) = [d for d in err.value.diagnostics if message in d.message]
    assert (diagnostic.loc.line, diagnostic.loc.col) == _at(text, line.split("\n")[0])  # its statement


@pytest.mark.parametrize("body, message, hint", [
    ('  vocab = "512"', "'vocab' must be an integer, not the string \"512\"", None),
    ("  max_seq = 2.5", "'max_seq' must be an integer, not 2.5", None),
    ("  embedding.tied = 1", "'embedding.tied' must be true or false, not 1", "true or false"),
    ('  embedding.tied = "false"', "'embedding.tied' must be true or false, not the string \"false\"",
     "true or false"),
    ("  embedding.tied = yes", "unknown name 'yes'", "true or false"),
    ("  let hd = 16\n  block x 2 {\n    attention.head_dim = hdd\n  }",
     "unknown name 'hdd' (for 'block.attention.head_dim', which wants an integer)",
     "did you mean 'hd'?"),
])
def test_values_are_strictly_typed(body, message, hint):
    text, diagnostics = _error(body)
    (diagnostic,) = diagnostics
    assert message in diagnostic.message
    assert hint is None or hint in diagnostic.hint
    statement = body.split("\n")[-2 if "hdd" in body else 0].strip()
    assert (diagnostic.loc.line, diagnostic.loc.col) == _at(text, statement)


def test_set_overrides_change_fields_as_text_would():
    from mxc.compiler.commands.refs import load_one

    spec = load_one("llama3.1-8b", ["d_model=2048", "block.attention.heads=16", "d_model=1024"])
    assert (spec.name, spec.d_model, spec.blocks["block"].attention.heads) == ("llama3.1-8b", 1024, 16)
    mla = load_one("mla-tiny", ["blocks.moe.mlp.top_k=3", "layers=dense x 2, moe"])
    assert mla.blocks["moe"].mlp.top_k == 3 and mla.layer_kinds == ("dense", "dense", "moe")


@pytest.mark.parametrize("override, message", [
    ("block.mlpp.hidden=64", "--set block.mlpp.hidden=64: unknown field 'mlpp'; did you mean 'mlp'?"),
    ("mlpp.hidden=64", "--set mlpp.hidden=64: unknown field 'mlpp'; did you mean 'mlp'?"),
    ("vocab=\"512\"", "--set vocab=\"512\": 'vocab' must be an integer, not the string \"512\""),
    ("d_model", "--set d_model: expected PATH=VALUE"),
])
def test_a_bad_override_is_one_error_naming_it(override, message):
    from mxc.compiler.commands import UserError
    from mxc.compiler.commands.refs import load_one

    with pytest.raises(UserError) as err:
        load_one("llama3-tiny", [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("command", [["check"], ["show"], ["plan", "-t", "cpu-8"],
                                     ["compile", "-t", "cpu-8"]])
def test_commands_take_set(command):
    result = _mxc(command[0], "llama3-tiny", *command[1:], "--set", "block.mlpp.hidden=64")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert ("mxc: error: --set block.mlpp.hidden=64: unknown field 'mlpp'; did you mean 'mlp'?"
            in result.stderr)


def test_show_applies_set():
    import json

    result = _mxc("show", "llama3-tiny", "--json", "--set", "d_model=128", "--set", "block.attention.heads=8")
    tree = json.loads(result.stdout)
    assert (tree["d_model"], tree["blocks"]["block"]["attention"]["heads"]) == (128, 8)


@pytest.mark.parametrize("body, needle, message, hint", [
    ("  layers = local global\n  vocab = 5", "global", "unexpected name 'global'", "separate the layer kinds with ','"),
    ("  blok x 2 {\n  }", "blok", "unknown statement 'blok'", "did you mean 'block'?"),
])
def test_syntax_errors_point_at_the_stray_name(body, needle, message, hint):
    text, diagnostics = _error(body)
    (diagnostic,) = diagnostics
    assert (diagnostic.message, diagnostic.hint) == (message, hint)
    assert (diagnostic.loc.line, diagnostic.loc.col) == _at(text, needle)


def test_mtp_deeper_than_max_seq_is_a_validation_error():
    text = "model m extends mla-tiny {\n  max_seq = 4\n  mtp = mtp(depth = 4, block = moe, loss_weight = 0.3)\n}\n"
    with pytest.raises(SpecError) as err:
        load_text(text, "m.mspec")
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.message == "mtp depth (4) must be less than max_seq (4)"
    assert (diagnostic.loc.line, diagnostic.loc.col) == _at(text, "depth")


def test_load_models_applies_overrides_to_a_file_with_one_model(tmp_path):
    from mxc.spec.load import load_models

    path = tmp_path / "m.mspec"
    path.write_text(BASE % "  vocab = 1024")
    (spec,) = load_models(str(path), ["vocab=2048"]).values()
    assert (spec.name, spec.vocab) == ("m", 2048)
