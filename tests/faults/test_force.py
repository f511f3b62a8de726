"""`--force` (issue 22): it replaces an mxc artifact and nothing else. A folder whose manifest.json
is not an artifact's (or was edited), or that holds files beside the artifact's, is refused with
a message naming what was found, and no user file is ever deleted. And what write_artifact writes
follows the user's umask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxc.compiler.artifact_writer import ArtifactExistsError, check_destination, write_artifact
from mxc.runtime.artifact import FORMAT_VERSION, Manifest


def _manifest() -> Manifest:
    """A small, valid manifest: no functions, one listed file."""
    return Manifest.model_validate({
        "format_version": FORMAT_VERSION, "model": "llama3-tiny", "spec": {}, "spec_hash": "0" * 64,
        "plan": {}, "run": {}, "functions": {}, "files": {},
        "topology": {"name": "cpu-8", "platform": "cpu", "chip": "cpu", "device_kind": "cpu", "chips": 8,
                     "devices": 8, "hbm_bytes": 0, "shape": [8], "mesh": {"fsdp": 8}, "device_ids": list(range(8))},
        "versions": {"jax": "0", "jaxlib": "0", "libtpu": None, "mxc": "0"}})


def _artifact(destination: Path, data: bytes = b"old") -> None:
    write_artifact(destination, _manifest(), {"weights.bin": data})


def test_force_replaces_an_artifact(tmp_path):
    destination = tmp_path / "out"
    _artifact(destination)
    replaced = write_artifact(destination, _manifest(), {"weights.bin": b"new"}, force=True)
    assert (destination / "weights.bin").read_bytes() == b"new"
    assert replaced.files == {"weights.bin": replaced.files["weights.bin"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_refuses_a_folder_whose_manifest_is_not_an_artifacts(tmp_path):
    destination = tmp_path / "notes"
    destination.mkdir()
    (destination / "manifest.json").write_text('{"name": "my shipping manifest"}')
    (destination / "thesis.tex").write_text("years of work")
    with pytest.raises(ArtifactExistsError, match=r"is not an mxc artifact \(.*format_version.*even with --force"):
        write_artifact(destination, _manifest(), {"weights.bin": b"new"}, force=True)
    assert (destination / "thesis.tex").read_text() == "years of work"
    assert (destination / "manifest.json").read_text() == '{"name": "my shipping manifest"}'


def test_force_refuses_an_artifact_whose_manifest_was_edited(tmp_path):
    destination = tmp_path / "out"
    _artifact(destination)
    data = json.loads((destination / "manifest.json").read_text())
    data["model"] = "someone-else"
    (destination / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactExistsError, match="manifest_sha256"):
        check_destination(destination, force=True)
    assert (destination / "weights.bin").read_bytes() == b"old"


def test_force_refuses_an_artifact_with_user_files_beside_it(tmp_path):
    destination = tmp_path / "out"
    _artifact(destination)
    (destination / "notes").mkdir()
    (destination / "notes" / "results.txt").write_text("loss curves")
    with pytest.raises(ArtifactExistsError, match=r"files its manifest does not list \(notes/results.txt\)"):
        write_artifact(destination, _manifest(), {"weights.bin": b"new"}, force=True)
    assert (destination / "notes" / "results.txt").read_text() == "loss curves"
    assert (destination / "weights.bin").read_bytes() == b"old"


def test_force_fills_an_empty_folder(tmp_path):
    destination = tmp_path / "empty"
    destination.mkdir()
    write_artifact(destination, _manifest(), {"weights.bin": b"new"}, force=True)
    assert (destination / "weights.bin").read_bytes() == b"new"


def test_artifact_files_and_folders_follow_the_umask(tmp_path):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        destination = tmp_path / "out"
        write_artifact(destination, _manifest(), {"weights.bin": b"w", "exports/train_step.bin": b"e"})
    finally:
        os.umask(previous)
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in [destination, *destination.rglob("*")]}
    assert modes == {"out": 0o755, "out/exports": 0o755, "out/exports/train_step.bin": 0o644,
                     "out/weights.bin": 0o644, "out/manifest.json": 0o644}


def test_the_compile_cache_replaces_an_entry_that_is_no_longer_intact(tmp_path, monkeypatch):
    from mxc.compiler import compile_cache

    monkeypatch.setenv("MXC_CACHE_DIR", str(tmp_path))
    entry = compile_cache.cache_root() / "key"
    _artifact(entry)
    (entry / "manifest.json").write_text("{}")  # damaged: --force would refuse it as an artifact
    compile_cache.store("key", _manifest(), {"weights.bin": b"new"})
    assert (entry / "weights.bin").read_bytes() == b"new"
