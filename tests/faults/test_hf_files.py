"""Issue 22, HF import/export: every file name read from an index or a layout stays inside its
folder, symlinks are followed only inside the source folder (or an HF cache's blobs/), an
import never deletes user files without --force, and a bad safetensors file is one `mxc: error`
naming it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from mxc.compiler.cli import main
from mxc.compiler.hf.convert import export_hf
from mxc.compiler.lower.params import param_shapes
from mxc.spec.load import load_model


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A small llama3-tiny HF checkpoint (config.json + model.safetensors)."""
    spec = load_model("llama3-tiny")
    params = jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), param_shapes(spec))
    directory = tmp_path_factory.mktemp("hf") / "ckpt"
    export_hf(spec, params, directory)
    return directory


@pytest.fixture
def hf_dir(hf_source, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(hf_source, copy)
    return copy


def _shard(hf_dir: Path, weights: Path, name: str) -> None:
    """Give hf_dir an index that names `name` as the shard of every tensor of `weights`."""
    with open(weights, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    weight_map = {k: name for k in header if k != "__metadata__"}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_import_refuses_an_index_naming_a_shard_outside_the_folder(hf_dir, tmp_path, capsys):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(hf_dir / "model.safetensors", outside)
    for name in ("../elsewhere.safetensors", str(outside)):
        _shard(hf_dir, outside, name)
        assert main(["import-hf", str(hf_dir), "-o", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "mxc: error:" in err and "not a plain file name" in err and "index.json" in err
        assert not (tmp_path / "out").exists()


def test_export_refuses_a_layout_naming_a_file_outside_the_folder(hf_dir, tmp_path, capsys):
    model = tmp_path / "model"
    assert main(["import-hf", str(hf_dir), "-o", str(model)]) == 0
    layout_path = model / "hf" / "layout.json"
    layout = json.loads(layout_path.read_text())
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("../victim.txt", str(victim)):
        layout["files"][0]["name"] = name
        layout_path.write_text(json.dumps(layout))
        assert main(["export-hf", str(model), "-o", str(tmp_path / "exported")]) == 1
        assert "not a plain file name" in capsys.readouterr().err
        assert victim.read_text() == "keep me"


def test_import_does_not_copy_symlinks_that_leave_the_folder(hf_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (hf_dir / "tokenizer.json").symlink_to(secret)
    (hf_dir / "notes.txt").write_text("inside")
    (hf_dir / "readme.txt").symlink_to(hf_dir / "notes.txt")  # inside the folder: kept
    model = tmp_path / "model"
    assert main(["import-hf", str(hf_dir), "-o", str(model)]) == 0
    assert not (model / "hf" / "tokenizer.json").exists()
    assert (model / "hf" / "readme.txt").read_text() == "inside"
    # A symlink planted in the model's hf/ record is not exported either.
    (model / "hf" / "vocab.txt").symlink_to(secret)
    assert main(["export-hf", str(model), "-o", str(tmp_path / "exported")]) == 0
    assert not (tmp_path / "exported" / "vocab.txt").exists()
    assert (tmp_path / "exported" / "readme.txt").read_text() == "inside"


def test_import_reads_an_hf_cache_snapshot(hf_source, tmp_path):
    """snapshots/<rev>/file -> ../../blobs/<hash>, as huggingface_hub lays out its cache."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(hf_source.iterdir())):
        shutil.copy(path, repo / "blobs" / f"hash{i}")
        (snapshot / path.name).symlink_to(Path("../../blobs") / f"hash{i}")
    (repo / "blobs" / "hashtok").write_text("{}")
    (snapshot / "tokenizer.json").symlink_to(Path("../../blobs/hashtok"))
    model = tmp_path / "model"
    assert main(["import-hf", str(snapshot), "-o", str(model)]) == 0
    assert (model / "hf" / "tokenizer.json").read_text() == "{}"
    assert (model / "hf" / "config.json").read_bytes() == (hf_source / "config.json").read_bytes()


def test_import_refuses_a_non_empty_output_without_force(hf_dir, tmp_path, capsys):
    model = tmp_path / "model"
    (model / "hf").mkdir(parents=True)
    (model / "hf" / "mine.txt").write_text("user file")
    (model / "notes.txt").write_text("user file")
    assert main(["import-hf", str(hf_dir), "-o", str(model)]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert (model / "hf" / "mine.txt").read_text() == "user file"
    assert not (model / "params").exists()
    assert main(["import-hf", str(hf_dir), "-o", str(model), "--force"]) == 0
    assert (model / "notes.txt").read_text() == "user file"  # not an import's file: kept
    assert (model / "model.mspec").is_file() and (model / "params").is_dir()


def test_import_refuses_a_float_tensor_relabelled_as_integer(hf_dir, tmp_path, capsys):
    path = hf_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + size].replace(b'"F32"', b'"I32"')
    path.write_bytes(bytes(data[:8]) + bytes(header) + bytes(data[8 + size:]))
    assert main(["import-hf", str(hf_dir), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mxc: error:" in err and "model.safetensors" in err and "int32" in err


@pytest.mark.parametrize("content", [b"", b"\xff" * 8 + b"{}", struct.pack("<Q", 5) + b"{nope"])
def test_a_malformed_safetensors_file_is_one_error_naming_it(hf_dir, tmp_path, capsys, content):
    (hf_dir / "model.safetensors").write_bytes(content)
    assert main(["import-hf", str(hf_dir), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mxc: error:" in err and "model.safetensors" in err and "Traceback" not in err


def test_a_config_that_is_no_object_is_one_error_naming_it(hf_dir, tmp_path, capsys):
    (hf_dir / "config.json").write_text("[1]")
    assert main(["import-hf", str(hf_dir), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "mxc: error:" in err and "config.json is not a JSON object" in err


@pytest.mark.parametrize("layout", ['{"files": 3}', '{"files": [{"x": 1}]}', '{"nofiles": []}',
                                    '{"files": [{"name": "a", "metadata": null, "tensors": [1]}]}'])
def test_a_malformed_layout_is_one_error_naming_it(hf_dir, tmp_path, capsys, layout):
    model = tmp_path / "model"
    assert main(["import-hf", str(hf_dir), "-o", str(model)]) == 0
    (model / "hf" / "layout.json").write_text(layout)
    assert main(["export-hf", str(model), "-o", str(tmp_path / "exported")]) == 1
    err = capsys.readouterr().err
    assert "mxc: error:" in err and "layout.json is not a checkpoint layout" in err
