"""`mxc tokenize` and `mxc generate` as a user meets them (issue 18): file modes, one set of generate
flags for a spec and an artifact, help for both forms, and clear errors for flags and prompt files
that do not apply."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

from mxc.runtime.tokenize import byte_tokenizer, tokenize_files

MXC = [str(Path(sys.executable).with_name("mxc"))]


def _mxc(*arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([*MXC, *arguments], env=env, capture_output=True, text=True, timeout=300)


def test_token_files_follow_the_umask(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world")
    previous = os.umask(0o022)
    try:
        tokenize_files([str(text)], str(tmp_path / "t.bin"), tokenizer=byte_tokenizer())
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "t.bin").stat().st_mode) == 0o644


def _fake_artifact(tmp_path: Path) -> Path:
    # `mxc generate` tells an artifact by its manifest; these checks run before anything reads it.
    artifact = tmp_path / "art"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    return artifact


def test_mxc_generate_artifact_passes_every_runtime_flag(tmp_path, monkeypatch):
    from mxc.compiler.cli import build_parser as mxc_parser
    from mxc.compiler.commands import generate
    from mxc.runtime.cli import build_parser as runtime_parser

    artifact = _fake_artifact(tmp_path)
    flags = ["--params", "ckpt", "--prompt-tokens", "p.npy", "--max-new", "3", "--temperature", "0.7",
             "--top-k", "5", "--top-p", "0.9", "--seed", "4", "-o", "out.npy", "--report", "r.json"]
    handed = []
    monkeypatch.setattr("mxc.compiler.commands.run.hand_over", lambda command, arguments: handed.append(arguments))
    args = mxc_parser().parse_args(["generate", str(artifact), *flags])
    generate.handler(args)
    direct = vars(runtime_parser().parse_args(["generate", str(artifact), *flags]))
    forwarded = vars(runtime_parser().parse_args(["generate", *handed[0]]))
    assert forwarded == direct and forwarded["report"] == "r.json"


def test_mxc_generate_help_describes_both_forms(tmp_path):
    done = _mxc("generate", str(_fake_artifact(tmp_path)), "--help")
    assert done.returncode == 0
    assert "ARTIFACT" in done.stdout and "--report" in done.stdout and "--dtype" in done.stdout


def test_dtype_with_an_artifact_is_refused(tmp_path):
    done = _mxc("generate", str(_fake_artifact(tmp_path)), "--params", "ckpt", "--prompt-tokens", "p.npy",
                "--max-new", "2", "-o", str(tmp_path / "o.npy"), "--dtype", "bfloat16")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "mxc: error: --dtype does not apply to the artifact" in done.stderr


def _runtime(*arguments: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "mxc.runtime", *arguments], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_token_file_as_prompt_is_refused_by_name(tmp_path):
    from mxc.compiler.commands import UserError
    from mxc.compiler.commands.forward import read_tokens

    text = tmp_path / "a.txt"
    text.write_text("hello")
    tokens = tmp_path / "t.bin"
    tokenize_files([str(text)], str(tokens), tokenizer=byte_tokenizer())
    done = _runtime("generate", str(_fake_artifact(tmp_path)), "--params", "ckpt", "--prompt-tokens", str(tokens),
                    "--max-new", "2", "-o", str(tmp_path / "o.npy"))
    assert done.returncode != 0 and "Traceback" not in done.stderr and "pickle" not in done.stderr
    assert f"--prompt-tokens {tokens} is a token file of mxc tokenize" in done.stderr and ".npy" in done.stderr
    try:  # the spec path (mxc forward; mxc generate MODEL likewise) reads prompts through the same function
        read_tokens(str(tokens), 512, "--prompt-tokens")
        raise AssertionError("a token file was read as a prompt array")
    except UserError as err:
        assert "is a token file of mxc tokenize" in str(err)


def test_a_pickled_npy_is_refused_naming_the_file(tmp_path):
    pickled = tmp_path / "p.npy"
    np.save(pickled, np.array([[1, "a"]], dtype=object), allow_pickle=True)
    done = _runtime("generate", str(_fake_artifact(tmp_path)), "--params", "ckpt", "--prompt-tokens", str(pickled),
                    "--max-new", "2", "-o", str(tmp_path / "o.npy"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"cannot read --prompt-tokens {pickled}" in done.stderr and ".npy array of int token ids" in done.stderr


def test_a_spec_refuses_an_empty_prompt_row_naming_the_file(tmp_path):
    import jax

    from mxc.compiler.lower.params import init_params
    from mxc.runtime.params_io import save_params
    from mxc.spec.load import load_model

    params = save_params(tmp_path / "params", init_params(load_model("llama3-tiny"), jax.random.key(0)))
    prompts = tmp_path / "p.npy"
    np.save(prompts, np.array([[5, 6, 7], [-1, -1, -1]], np.int32))  # -1 pads a shorter row: this one is empty
    done = _mxc("generate", "llama3-tiny", "--params", str(params), "--prompt-tokens", str(prompts),
                "--max-new", "2", "-o", str(tmp_path / "o.npy"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"mxc: error: --prompt-tokens {prompts}: prompt row 1 is empty" in done.stderr
