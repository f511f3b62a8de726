"""Files a manifest lists are read only up to the size it records: a file of another size is
refused, naming it and both sizes, before its bytes are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxc.compiler.artifact_writer import write_artifact
from mxc.runtime import artifact_reader
from mxc.runtime.artifact import FORMAT_VERSION, ArtifactError, manifest_digest
from mxc.runtime.artifact_reader import read_manifest, read_verified

from test_force import _manifest


@pytest.fixture
def artifact(tmp_path) -> Path:
    destination = tmp_path / "art"
    write_artifact(destination, _manifest(), {"weights.bin": b"0123456789"})
    return destination


def _rewrite(artifact: Path, change) -> None:
    path = artifact / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    data["manifest_sha256"] = manifest_digest(data)  # as a tool that knows the format would
    path.write_text(json.dumps(data))


def test_the_manifest_records_each_file_size(artifact):
    assert read_manifest(artifact).file_sizes == {"weights.bin": 10}
    assert read_verified(artifact, trusted_keys=()).contents == {"weights.bin": b"0123456789"}


def test_a_larger_file_is_refused_naming_both_sizes(artifact):
    with open(artifact / "weights.bin", "ab") as f:
        f.write(b"x" * 5000)
    with pytest.raises(ArtifactError, match=r"weights.bin is corrupt or was modified: expected 10 bytes "
                                            r"\(as its manifest records\), found 5,010"):
        read_verified(artifact, trusted_keys=())


def test_a_shorter_file_is_refused_with_both_sizes(artifact):
    (artifact / "weights.bin").write_bytes(b"0123")
    with pytest.raises(ArtifactError, match=r"weights.bin .*expected 10 bytes .*found 4"):
        read_verified(artifact, trusted_keys=())


def test_a_manifest_without_sizes_is_refused_with_a_rebuild_message(artifact):
    _rewrite(artifact, lambda data: data.pop("file_sizes"))
    with pytest.raises(ArtifactError, match=r"records no size for weights.bin.*compile the model again"):
        read_verified(artifact, trusted_keys=())


def test_an_artifact_of_the_format_before_sizes_asks_for_a_rebuild(artifact):
    _rewrite(artifact, lambda data: data.update(format_version=FORMAT_VERSION - 1))
    with pytest.raises(ArtifactError, match=r"no longer reads.*compile the model again"):
        read_manifest(artifact)


def _older_format(data: dict) -> None:
    data.update(format_version=FORMAT_VERSION - 1)
    data.pop("file_sizes", None)


def test_force_replaces_an_artifact_of_an_older_format(artifact):
    """Too old to run, but still ours: `mxc compile --force` rebuilds it in place (the README's
    main job does that after an upgrade)."""
    _rewrite(artifact, _older_format)
    write_artifact(artifact, _manifest(), {"weights.bin": b"new"}, force=True)
    assert read_manifest(artifact).format_version == FORMAT_VERSION
    assert (artifact / "weights.bin").read_bytes() == b"new"


@pytest.mark.parametrize("damage", ["digest", "unlisted file"])
def test_force_still_refuses_an_older_artifact_it_cannot_vouch_for(artifact, damage):
    from mxc.compiler.artifact_writer import ArtifactExistsError

    _rewrite(artifact, _older_format)
    if damage == "digest":
        path = artifact / "manifest.json"
        path.write_text(path.read_text().replace('"weights.bin"', '"other.bin"', 1))
    else:
        (artifact / "notes.txt").write_text("the user's")
    with pytest.raises(ArtifactExistsError, match="refusing to replace it, even with --force"):
        write_artifact(artifact, _manifest(), {"weights.bin": b"new"}, force=True)
