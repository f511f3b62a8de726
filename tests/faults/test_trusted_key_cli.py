"""`--trusted-key FILE` on the runtime's commands: with it, an artifact that no given key signed
is refused before anything else is read (the data, the devices, the parameters); a key file
that cannot be used is one `mxc: error` naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mxc.compiler.artifact_writer import write_artifact
from mxc.runtime.signing import sign_artifact

from test_force import _manifest
from test_signing import _keypair

PYTHON = sys.executable
MXC = str(Path(sys.executable).with_name("mxc"))


def cpu_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu"}


@pytest.fixture
def keys(tmp_path):
    return _keypair(tmp_path, "mine"), _keypair(tmp_path, "other")


@pytest.fixture
def artifact(tmp_path) -> Path:
    destination = tmp_path / "art"
    write_artifact(destination, _manifest(), {"weights.bin": b"weights"})
    return destination


def _run(artifact: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([MXC, "run", str(artifact), "--data", str(artifact.parent / "absent.bin"), "--steps", "1",
                           "--ckpt-dir", str(artifact.parent / "ckpt"), *flags],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)


def test_run_refuses_an_unsigned_artifact(artifact, keys):
    (_, public), _ = keys
    done = _run(artifact, "--trusted-key", str(public))
    assert done.returncode == 1, done.stderr
    assert f"mxc: error: {artifact} is not signed" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_refuses_an_artifact_signed_by_another_key(artifact, keys):
    (_, public), (other_private, _) = keys
    sign_artifact(artifact, other_private)
    done = _run(artifact, "--trusted-key", str(public))
    assert done.returncode == 1, done.stderr
    assert "is not signed by a trusted key" in done.stderr


def test_any_of_several_trusted_keys_will_do(artifact, keys):
    (private, public), (_, other_public) = keys
    sign_artifact(artifact, private)
    done = _run(artifact, "--trusted-key", str(other_public), "--trusted-key", str(public))
    assert "signed" not in done.stderr
    assert "has no init function" in done.stderr  # loaded: what stops it is that this artifact cannot train


def test_a_bad_key_file_is_one_error_naming_it(artifact, tmp_path):
    for key, message in ((tmp_path / "missing.pem", "cannot read key"), (artifact / "weights.bin", "not a PEM")):
        done = _run(artifact, "--trusted-key", str(key))
        assert done.returncode == 1, done.stderr
        assert "mxc: error: " in done.stderr and str(key) in done.stderr and message in done.stderr
        assert "Traceback" not in done.stderr


def test_generate_refuses_an_unsigned_artifact_before_reading_the_parameters(artifact, keys, tmp_path):
    (_, public), _ = keys
    np.save(tmp_path / "prompt.npy", np.ones((1, 2), np.int32))
    done = subprocess.run([PYTHON, "-m", "mxc.runtime", "generate", str(artifact), "--params",
                           str(tmp_path / "absent"), "--prompt-tokens", str(tmp_path / "prompt.npy"), "--max-new", "1",
                           "-o", str(tmp_path / "out.npy"), "--trusted-key", str(public)],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"mxc: error: {artifact} is not signed" in done.stderr


@pytest.mark.parametrize("model", ["artifact", "spec"])
def test_mxc_generate_forwards_the_key_to_an_artifact_and_refuses_it_for_a_spec(artifact, keys, tmp_path, model):
    (_, public), _ = keys
    np.save(tmp_path / "prompt.npy", np.ones((1, 2), np.int32))
    target = str(artifact) if model == "artifact" else "llama3-tiny"
    done = subprocess.run([MXC, "generate", target, "--params", str(tmp_path / "absent"), "--prompt-tokens",
                           str(tmp_path / "prompt.npy"), "--max-new", "1", "-o", str(tmp_path / "out.npy"),
                           "--trusted-key", str(public)], env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    expected = (f"mxc: error: {artifact} is not signed" if model == "artifact"
                else "mxc: error: --trusted-key checks an artifact's signature; llama3-tiny is no artifact")
    assert expected in done.stderr, done.stderr


def test_inspect_refuses_an_unsigned_artifact_and_shows_a_signed_one(artifact, keys):
    (private, public), _ = keys
    command = [MXC, "inspect", str(artifact), "--json", "--trusted-key", str(public)]
    done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"mxc: error: {artifact} is not signed" in done.stderr, done.stderr
    sign_artifact(artifact, private)
    done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"model": "llama3-tiny"' in done.stdout
