"""Issue 22: a manifest is read as untrusted JSON (bounded depth and size, no duplicate keys),
and export-hf --params takes a run directory like generate --params does."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from mxc.compiler.artifact_writer import write_artifact
from mxc.compiler.cli import main
from mxc.compiler.lower.params import param_shapes
from mxc.runtime import strict_json
from mxc.runtime.artifact import ArtifactError
from mxc.runtime.artifact_reader import read_manifest
from mxc.runtime.checkpoint import Checkpoints
from mxc.spec.load import load_model

from test_force import _manifest


@pytest.fixture
def artifact(tmp_path) -> Path:
    destination = tmp_path / "art"
    write_artifact(destination, _manifest(), {"weights.bin": b"w"})
    return destination


def test_a_duplicate_key_in_a_manifest_is_refused(artifact):
    path = artifact / "manifest.json"
    text = path.read_text()
    # The first "model" would lose to the later one, so the hash would still match.
    path.write_text(text.replace("{", '{"model": "something-else", ', 1))
    with pytest.raises(ArtifactError, match=r"manifest.json.*'model' appears twice"):
        read_manifest(artifact)


def test_a_deep_manifest_is_one_error_naming_it(artifact):
    (artifact / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ArtifactError, match=r"manifest.json nests deeper"):
        read_manifest(artifact)
    (artifact / "manifest.json").write_text('{"a": ' * 100 + "1" + "}" * 100)
    with pytest.raises(ArtifactError, match=r"manifest.json nests deeper"):
        read_manifest(artifact)


def test_a_huge_manifest_is_refused_before_it_is_parsed(artifact, monkeypatch):
    monkeypatch.setattr(strict_json, "MAX_BYTES", 1000)
    monkeypatch.setattr(strict_json.read_bounded, "__defaults__", (1000,))
    (artifact / "manifest.json").write_text(" " * 5000 + "{}")
    with pytest.raises(ArtifactError, match=r"manifest.json is larger than 1,000 bytes"):
        read_manifest(artifact)


def test_a_manifest_that_is_no_object_is_refused(artifact):
    (artifact / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match=r"manifest.json is not a JSON object"):
        read_manifest(artifact)


def test_export_hf_takes_a_run_directory(tmp_path):
    spec = load_model("llama3-tiny")
    params = jax.tree.map(lambda s: np.full(s.shape, 0.02, s.dtype), param_shapes(spec))
    run = tmp_path / "run"
    checkpoints = Checkpoints(run, async_save=False)
    checkpoints.save(3, params=params, optimizer={"count": np.zeros((), np.int32)}, meta={"step": 3})
    checkpoints.close()
    assert main(["export-hf", "llama3-tiny", "--params", str(run), "-o", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "sub/../../x", ".."])
def test_a_manifest_naming_a_file_outside_the_artifact_is_refused(artifact, name):
    from mxc.runtime.artifact import manifest_digest

    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    data["files"][name] = "0" * 64
    data["manifest_sha256"] = manifest_digest(data)  # as a tool that knows the format would
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="not a plain file name"):
        read_manifest(artifact)
