"""The `mxc` command line: check, show, schema, fmt, and how it reports errors."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mxc.compiler import cli
from mxc.compiler.commands.check import pattern_text
from mxc.compiler.commands import units
from mxc.spec import ModelSpec, load_model, zoo_names
from mxc.spec.format import format_text
from runtime_support import child

MXC = Path(sys.executable).with_name("mxc")


def run_mxc(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "MXC_DEBUG"}
    return subprocess.run([str(MXC), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """In-process, for speed: the same main() the console script calls."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def tiny_block(heads=4, kv_heads=2, head_dim=16, hidden=128, extra=""):
    return (f"attention = gqa(heads = {heads}, kv_heads = {kv_heads}, head_dim = {head_dim}, "
            f"rope = rope(theta = 10000){extra})\n"
            f"    mlp = glu(hidden = {hidden}, act = silu)\n"
            "    norm = rmsnorm(eps = 1e-5)")


TWO_MODELS = f"""
model small {{
  vocab = 512
  d_model = 64
  max_seq = 256
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  block x 2 {{
    {tiny_block()}
  }}
}}

model wider extends small {{
  d_model = 128
  embedding.tied = true
  block x 3 {{
    mlp.hidden = 256
  }}
}}
"""

PATTERN_MODEL = f"""
model banded {{
  vocab = 256
  d_model = 32
  max_seq = 128
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-6)
  layers = (local x 5, global) x 4, local x 2
  block local {{
    {tiny_block(extra=", window = 16")}
  }}
  block global {{
    {tiny_block()}
  }}
}}
"""


def dense_params(vocab, d_model, heads, kv_heads, head_dim, hidden, layers, tied):
    """Llama-style parameter count written out tensor by tensor (q, k, v, o; gate, up, down)."""
    attention = d_model * heads * head_dim * 2 + d_model * kv_heads * head_dim * 2
    glu = 3 * d_model * hidden
    norms = 2 * d_model
    head = 0 if tied else vocab * d_model
    return vocab * d_model + head + d_model + layers * (attention + glu + norms)


@pytest.fixture
def two_models(tmp_path):
    path = tmp_path / "two.mspec"
    path.write_text(TWO_MODELS)
    return path


# ------------------------------------------------------------------ check


def test_check_zoo_model_json_via_console_script():
    result = run_mxc("check", "llama3.1-8b", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["name"] == "llama3.1-8b"
    assert summary["total_params"] == 8030261248  # Meta's published count
    assert summary["active_params"] == 8030261248
    assert summary["mtp_params"] == 0
    assert summary["num_layers"] == 32
    assert summary["layer_pattern"] == [{"period": ["block"], "repeat": 32}]
    assert summary["flops_seq"] == 4096
    assert result.stderr == ""


def test_check_text_summary(capsys):
    code, out, err = run_main(capsys, "check", "llama3.1-8b")
    assert code == 0, err
    assert "8.03B" in out and "8,030,261,248" in out
    assert "32: block x32" in out
    assert "gqa" in out and "glu" in out and "untied" in out
    assert "params float32, compute bfloat16" in out
    assert "at seq 4096" in out and "GFLOP" in out


def test_check_file_with_several_models(capsys, two_models):
    code, out, err = run_main(capsys, "check", str(two_models), "--json")
    assert code == 0, err
    summaries = json.loads(out)
    assert [s["name"] for s in summaries] == ["small", "wider"]
    assert summaries[0]["total_params"] == dense_params(512, 64, 4, 2, 16, 128, 2, tied=False)
    assert summaries[1]["total_params"] == dense_params(512, 128, 4, 2, 16, 256, 3, tied=True)
    assert summaries[1]["num_layers"] == 3


def test_check_file_colon_name_picks_one_model(capsys, two_models):
    code, out, err = run_main(capsys, "check", f"{two_models}:wider", "--json")
    assert code == 0, err
    assert json.loads(out)["name"] == "wider"  # one model: an object, not a list


def test_check_text_shows_layer_pattern_and_kinds(capsys, tmp_path):
    path = tmp_path / "banded.mspec"
    path.write_text(PATTERN_MODEL)
    code, out, err = run_main(capsys, "check", str(path))
    assert code == 0, err
    assert "26: (local x5, global) x4, local x2" in out
    assert "tied with the output head" in out
    # The per-kind table: one column per block kind, the window only on the local one.
    window_row = next(line for line in out.splitlines() if "window" in line)
    assert window_row.split()[1:5] == ["window", "16", "-", "│"]


def test_check_seq_changes_attention_flops(capsys):
    code, out, _ = run_main(capsys, "check", "llama3-tiny", "--json", "--seq", "64")
    short = json.loads(out)
    code2, out2, _ = run_main(capsys, "check", "llama3-tiny", "--json", "--seq", "128")
    long = json.loads(out2)
    assert code == code2 == 0
    assert (short["flops_seq"], long["flops_seq"]) == (64, 128)
    # Causal attention: QK^T and AV over seq/2 keys on average, 3x for forward + backward.
    per_key = 3 * 2 * 4 * (16 + 16) * 2  # heads 4, head_dim 16, two layers
    assert long["attention_flops_per_token"] - short["attention_flops_per_token"] == per_key * (64 - 32)


def test_check_several_refs_reports_every_failure(capsys, two_models, tmp_path):
    code, out, err = run_main(capsys, "check", "--json", "llama3-tiny", str(tmp_path / "gone.mspec"),
                              "llama3.1-8c", f"{two_models}:nope")
    assert code == 1
    report = json.loads(out)  # with a failure: {models, diagnostics}, so editors and CI read both
    assert [m["name"] for m in report["models"]] == ["llama3-tiny"]  # the valid one is still summarised
    assert len(report["diagnostics"]) == 3
    assert f"mxc: error: no such file: {tmp_path / 'gone.mspec'}" in err
    assert "no such file or zoo model 'llama3.1-8c'; did you mean 'llama3.1-8b'?" in err
    assert "has no model 'nope'" in err and "small, wider" in err


def test_check_list(capsys):
    code, out, err = run_main(capsys, "check", "--list")
    assert code == 0, err
    for name in zoo_names():
        assert name in out
    row = next(line for line in out.splitlines() if " llama3.1-8b " in line)
    assert "8.03B" in row and "8,030,261,248" in row


def test_check_list_json(capsys):
    code, out, _ = run_main(capsys, "check", "--list", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert list(rows) == zoo_names()
    assert rows["llama3.1-8b"]["total_params"] == 8030261248


@pytest.mark.parametrize("args, code, message", [
    (["check", "llama3-tiny", "--seq", "0"], 1, "mxc: error: --seq must be a positive"),
    (["check", "llama3-tiny", "--seq", "many"], 2, "invalid int value"),
    (["check"], 1, "mxc: error: nothing to check"),
    (["check", "--list", "llama3-tiny"], 1, "mxc: error: --list takes no REF"),
    ([], 2, "usage: mxc"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_usage_errors(capsys, args, code, message):
    got, _, err = run_main(capsys, *args)
    assert got == code
    assert message in err


def test_missing_file_via_console_script(tmp_path):
    result = run_mxc("check", "missing.mspec", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == "mxc: error: no such file: missing.mspec"
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_spec_error_exits_1_with_diagnostic(tmp_path):
    path = tmp_path / "bad.mspec"
    path.write_text(TWO_MODELS.replace("kv_heads = 2", "kv_heads = 3"))
    result = run_mxc("check", str(path))
    assert result.returncode == 1
    assert result.stderr.startswith(f"{path}:9:")
    assert "heads (4) is not divisible by kv_heads (3)" in result.stderr
    assert "Traceback" not in result.stderr


def test_internal_error_is_reported_without_traceback(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr("mxc.compiler.commands.schema.handler", broken)
    monkeypatch.delenv("MXC_DEBUG", raising=False)
    code, out, err = run_main(capsys, "schema")
    assert code == 3
    assert err.splitlines()[0] == "mxc: internal error: RuntimeError: boom"
    assert "report" in err and "MXC_DEBUG=1" in err
    assert "Traceback" not in err
    monkeypatch.setenv("MXC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["schema"])


def test_start_up_imports_nothing_heavy():
    """Building the parser (what `mxc --help` does) must not pull in jax, lark, pydantic or rich."""
    result = subprocess.run(child("parser_imports"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("mxc ")


# ------------------------------------------------------------------ show, schema


def test_show_json_round_trips(capsys):
    code, out, err = run_main(capsys, "show", "llama3.1-8b", "--json")
    assert code == 0, err
    spec = ModelSpec.model_validate(json.loads(out))
    assert spec == load_model("llama3.1-8b")


def test_show_text_is_indented_key_values(capsys):
    code, out, _ = run_main(capsys, "show", "llama3.2-1b")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "name: llama3.2-1b"
    assert "d_model: 2048" in lines
    assert "  block:" in lines
    assert "    attention: gqa" in lines
    assert "      head_dim: 64" in lines
    assert "          factor: 32.0" in lines  # attention.rope.scaling.factor, overridden
    assert "  - period: [block]" in lines and "    repeat: 16" in lines


def test_show_needs_one_model(capsys, two_models):
    code, _, err = run_main(capsys, "show", str(two_models))
    assert code == 1
    assert "declares 2 models (small, wider)" in err and f"{two_models}:NAME" in err
    code, out, _ = run_main(capsys, "show", f"{two_models}:small", "--json")
    assert code == 0 and json.loads(out)["d_model"] == 64


def test_schema_is_json_schema_of_the_ir():
    result = run_mxc("schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert schema["type"] == "object"
    assert set(schema["properties"]) == set(ModelSpec.model_fields)
    assert set(schema["required"]) >= {"vocab", "d_model", "blocks", "layers"}
    assert schema["additionalProperties"] is False


# ------------------------------------------------------------------ fmt

MESSY = """model   messy   {
vocab=512
  d_model = 64     # a comment stays
  max_seq = 256
  embedding = embedding( tied = false )
  final_norm = rmsnorm(eps = 1e-5)
  block x 2 {
  attention = gqa(heads = 4, kv_heads = 2, head_dim = 16, rope = rope(theta = 10000))
      mlp = glu(hidden = 128, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
"""


def test_fmt_check_rewrites_nothing_and_lists_changes(capsys, tmp_path):
    messy = tmp_path / "messy.mspec"
    messy.write_text(MESSY)
    clean = tmp_path / "clean.mspec"
    clean.write_text(format_text(MESSY, str(clean)))
    assert clean.read_text() != MESSY
    code, out, err = run_main(capsys, "fmt", "--check", str(messy), str(clean))
    assert code == 1, err
    assert out.splitlines() == [f"would reformat {messy}"]
    assert messy.read_text() == MESSY


def test_fmt_rewrites_in_place_atomically(capsys, tmp_path):
    messy = tmp_path / "messy.mspec"
    messy.write_text(MESSY)
    messy.chmod(0o640)
    clean = tmp_path / "clean.mspec"
    clean.write_text(format_text(MESSY, str(clean)))
    clean_before = clean.stat()
    code, out, err = run_main(capsys, "fmt", str(messy), str(clean))
    assert code == 0, err
    assert out.splitlines() == [f"reformatted {messy}"]
    assert messy.read_text() == format_text(MESSY, str(messy))
    assert "# a comment stays" in messy.read_text()
    assert stat.S_IMODE(messy.stat().st_mode) == 0o640
    # An unchanged file is not written at all.
    assert (clean.stat().st_ino, clean.stat().st_mtime_ns) == (clean_before.st_ino, clean_before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.mspec", "messy.mspec"]  # no temp files
    # The result is canonical and still means the same models.
    assert run_main(capsys, "fmt", "--check", str(messy))[0] == 0
    original = tmp_path / "original.mspec"
    original.write_text(MESSY)
    assert load_model(str(messy)) == load_model(str(original))


def test_fmt_leaves_a_file_with_a_syntax_error_untouched(tmp_path):
    broken = tmp_path / "broken.mspec"
    text = MESSY.replace("max_seq = 256", "max_seq = = 256")
    broken.write_text(text)
    messy = tmp_path / "messy.mspec"
    messy.write_text(MESSY)
    result = run_mxc("fmt", str(broken), str(messy))
    assert result.returncode == 1
    assert result.stderr.startswith(f"{broken}:4:13: error: unexpected '='")
    assert "Traceback" not in result.stderr
    assert broken.read_text() == text
    assert messy.read_text() != MESSY  # the other file is still formatted


def test_fmt_missing_file(capsys, tmp_path):
    code, _, err = run_main(capsys, "fmt", str(tmp_path / "nope.mspec"))
    assert code == 1
    assert "mxc: error: no such file" in err


# ------------------------------------------------------------------ pieces


@pytest.mark.parametrize("pattern, text", [
    ([{"period": ["block"], "repeat": 32}], "block x32"),
    ([{"period": ["local"] * 5 + ["global"], "repeat": 4}, {"period": ["local"], "repeat": 2}],
     "(local x5, global) x4, local x2"),
    ([{"period": ["dense"], "repeat": 3}, {"period": ["moe"], "repeat": 58}], "dense x3, moe x58"),
    ([{"period": ["a", "b"], "repeat": 1}], "a, b"),
    ([{"period": ["only"], "repeat": 1}], "only"),
])
def test_pattern_text(pattern, text):
    assert pattern_text(pattern) == text


@pytest.mark.parametrize("value, text", [
    (8030261248, "8.03B"), (70553706496, "70.6B"), (405853388800, "406B"), (999_600_000, "1B"),
    (999_400_000, "999M"), (139584, "140K"), (999, "999"), (0, "0"),
])
def test_units_count(value, text):
    assert units.count(value) == text


def test_units_flops_and_bytes():
    assert units.flops(48249176064.0) == "48.2 GFLOP"
    assert units.flops(12.0) == "12 FLOP"
    assert units.size_bytes(3 * 2**29) == "1.5 GiB"
    assert units.size_bytes(1000) == "1000 B"


WORKFLOW_ORDER = ["check", "show", "fmt", "schema", "topologies", "plan", "compile", "inspect",
                  "tokenize", "run", "generate", "forward", "import-hf", "export-hf"]


def test_help_lists_commands_in_workflow_order(capsys):
    code, out, _ = run_main(capsys, "--help")
    listed = [line.split()[0] for line in out.split("COMMAND\n", 1)[1].splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    assert code == 0 and [name for name in listed if name in WORKFLOW_ORDER] == WORKFLOW_ORDER
