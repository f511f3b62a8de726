"""Issue 22: optional signing. `mxc compile --sign KEY` signs the manifest (which hashes every
file); a runtime given trusted keys loads only artifacts one of them signed, and checks that
before it reads anything else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mxc.compiler.artifact_writer import write_artifact
from mxc.runtime import artifact_reader
from mxc.runtime.artifact import ArtifactError
from mxc.runtime.artifact_reader import read_verified
from mxc.runtime.signing import SIGNATURE_NAME, TRUSTED_KEYS_ENV, sign_artifact

from test_force import _manifest


def _keypair(folder: Path, name: str) -> tuple[Path, Path]:
    key = Ed25519PrivateKey.generate()
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def keys(tmp_path):
    return _keypair(tmp_path, "mine"), _keypair(tmp_path, "other")


@pytest.fixture
def artifact(tmp_path) -> Path:
    destination = tmp_path / "art"
    write_artifact(destination, _manifest(), {"weights.bin": b"weights", "sub.bin": b"more"})
    return destination


def test_a_signed_artifact_loads_with_its_key(artifact, keys):
    (private, public), (_, other_public) = keys
    sign_artifact(artifact, private)
    assert read_verified(artifact, trusted_keys=[public]).contents["weights.bin"] == b"weights"
    assert read_verified(artifact, trusted_keys=[other_public, public]).manifest.model == "llama3-tiny"
    assert read_verified(artifact).manifest.model == "llama3-tiny"  # no trusted keys: no check


def test_an_unsigned_artifact_is_refused_when_keys_are_trusted(artifact, keys):
    (_, public), _ = keys
    with pytest.raises(ArtifactError, match="is not signed"):
        read_verified(artifact, trusted_keys=[public])


def test_an_artifact_signed_by_another_key_is_refused(artifact, keys):
    (_, public), (other_private, _) = keys
    sign_artifact(artifact, other_private)
    with pytest.raises(ArtifactError, match="not signed by a trusted key"):
        read_verified(artifact, trusted_keys=[public])


def test_the_environment_names_trusted_keys(artifact, keys, monkeypatch):
    (_, public), (other_private, _) = keys
    sign_artifact(artifact, other_private)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    with pytest.raises(ArtifactError, match="not signed by a trusted key"):
        read_verified(artifact)


def test_any_changed_byte_of_any_file_is_refused(artifact, keys):
    (private, public), _ = keys
    sign_artifact(artifact, private)
    for path in sorted(p for p in artifact.iterdir()):
        original = path.read_bytes()
        for position in (0, len(original) // 2, len(original) - 1):
            changed = bytearray(original)
            changed[position] ^= 0x01
            path.write_bytes(bytes(changed))
            with pytest.raises(ArtifactError):
                read_verified(artifact, trusted_keys=[public])
            path.write_bytes(original)
    read_verified(artifact, trusted_keys=[public])


def test_the_signature_is_checked_before_the_manifest_is_parsed(artifact, keys, monkeypatch):
    (_, public), _ = keys
    parsed = []
    monkeypatch.setattr(artifact_reader, "parse_json", lambda *a: parsed.append(a) or {})
    with pytest.raises(ArtifactError, match="is not signed"):
        read_verified(artifact, trusted_keys=[public])
    assert parsed == []


def test_compile_sign_writes_a_signature_the_runtime_accepts(tmp_path, keys):
    (private, public), (_, other_public) = keys
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "MXC_DEBUG")}
    env.update(MXC_CACHE_DIR=str(tmp_path / "cache"), ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               XLA_FLAGS="--xla_backend_optimization_level=0")
    output = tmp_path / "signed"
    done = subprocess.run([str(Path(sys.executable).with_name("mxc")), "compile", "llama3-tiny", "--topology",
                           "cpu-8", "--seq", "32", "--batch", "8", "--functions", "eval_step", "-o", str(output),
                           "--sign", str(private)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (output / SIGNATURE_NAME).is_file()
    read_verified(output, trusted_keys=[public])
    with pytest.raises(ArtifactError, match="not signed by a trusted key"):
        read_verified(output, trusted_keys=[other_public])
    bad = subprocess.run([str(Path(sys.executable).with_name("mxc")), "compile", "llama3-tiny", "--topology",
                          "cpu-8", "-o", str(tmp_path / "x"), "--sign", str(public)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert bad.returncode == 1 and "mxc: error:" in bad.stderr and "private key" in bad.stderr


def test_force_replaces_a_signed_artifact(artifact, keys):
    (private, _), _ = keys
    sign_artifact(artifact, private)
    write_artifact(artifact, _manifest(), {"weights.bin": b"new", "sub.bin": b"more"}, force=True)
    assert (artifact / "weights.bin").read_bytes() == b"new"
    assert not (artifact / SIGNATURE_NAME).exists()  # the new build is not signed by the old key


def test_copying_a_cache_entry_asks_no_signer(artifact, keys, monkeypatch, tmp_path):
    from mxc.compiler.artifact_writer import copy_artifact

    (_, public), _ = keys
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    copy_artifact(artifact, tmp_path / "copy")
    assert (tmp_path / "copy" / "weights.bin").read_bytes() == b"weights"
