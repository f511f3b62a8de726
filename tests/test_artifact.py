"""The runtime side of artifacts: a tiny model compiled for cpu-8 is loaded in a second process by
mxc.runtime alone and its results equal a jit of the same functions; every kind of mismatch is
refused, with what was expected and what was found, before anything is deserialised."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from artifact_builds import (FAST_CPU_FLAGS, TINY_CPU8, TINY_V5P8, built, child_report, clean_env, rewrite_manifest,
                             run_mxc)
from mxc.runtime.artifact import ArtifactError, FORMAT_VERSION
from runtime_support import child


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def tiny(base) -> Path:
    return built(base, TINY_CPU8)


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> Path:
    copy = tmp_path / "artifact"
    shutil.copytree(tiny, copy)
    return copy


def test_second_process_loads_it_and_matches_jit(tiny, base, tmp_path):
    recompile_copy = tmp_path / "other-versions"
    shutil.copytree(tiny, recompile_copy)
    # Other library versions, and a compiler option this compiler does not have (as a newer
    # compiler may have dropped one): recompiled from StableHLO without it, and said so.
    rewrite_manifest(recompile_copy, lambda m: (m["versions"].update(jaxlib="0.0.1"),
                                                m.update(compiler_options={"xla_no_such_option": True})))
    env = clean_env(base, JAX_PLATFORMS="cpu",
                    XLA_FLAGS=f"{FAST_CPU_FLAGS} --xla_force_host_platform_device_count=8")
    # The artifact's functions through mxc.runtime alone, then the same functions jitted from the
    # zoo's spec with the artifact's plan on the same 8 devices, compared leaf by leaf.
    result = child_report("artifact_against_jit", str(tiny), str(recompile_copy), env=env)
    assert result["forbidden"] == [], "the runtime imported compiler/spec/lark modules"
    assert result["native"]["leaves"] > 20
    assert result["native"]["unequal"] == {}
    assert result["recompiled"]["unequal"] == {}
    assert 5.0 < result["loss"] < 7.5  # about ln(512) for a fresh model
    assert result["index"] == 17  # 16 prompt tokens and one decoded
    assert len(result["warned"]) == 2
    refused, recompiled = result["warned"]
    assert "refuses the artifact's compiler options" in refused and "xla_no_such_option" in refused
    assert "jaxlib 0.0.1 -> " in recompiled and "recompiled 5 functions from StableHLO in" in recompiled


# ------------------------------------------------------------------ refusals

@pytest.fixture
def no_deserialising(monkeypatch):
    """Fails the test if the runtime gets as far as deserialising or compiling an executable."""
    import mxc.runtime.program as program

    def forbidden(*args, **kwargs):
        raise AssertionError("an executable was deserialised despite a refusal")

    monkeypatch.setattr(program, "_native_runner", forbidden)
    monkeypatch.setattr(program, "_recompiled_runner", forbidden)


def _files(artifact: Path) -> list[str]:
    return sorted(json.loads((artifact / "manifest.json").read_text())["files"]) + ["manifest.json"]


def test_every_file_is_covered(tiny):
    names = _files(tiny)
    on_disk = sorted(p.relative_to(tiny).as_posix() for p in tiny.rglob("*") if p.is_file())
    assert sorted(names) == sorted(on_disk)
    assert len(names) == 2 * 5 + 1  # executable and export of 5 functions, and the manifest


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_a_flipped_byte_in_any_file_is_refused(tiny, tmp_path, where, no_deserialising):
    import mxc.runtime

    for name in _files(tiny):
        copy = tmp_path / f"{name}-{where}"
        shutil.copytree(tiny, copy)
        path = copy / name
        data = bytearray(path.read_bytes())
        data[int(len(data) * where)] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(ArtifactError) as refused:
            mxc.runtime.load(copy)
        message = str(refused.value)
        # The integrity checks name the file; a flip that breaks JSON or a version is refused
        # by the parser or the format check first.
        assert (name in message and "expected" in message and "found" in message) or \
            "not valid JSON" in message or "format" in message, message


def test_a_flipped_byte_is_refused_by_the_cli(tiny_copy, base):
    path = tiny_copy / "train_step.executable"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    done = run_mxc(base, "inspect", str(tiny_copy), "--check")
    assert done.returncode == 1
    assert "train_step.executable is corrupt or was modified: expected sha256" in done.stderr
    assert done.stdout == ""


def test_a_format_from_the_future_is_refused(tiny_copy, base, no_deserialising):
    import mxc.runtime

    rewrite_manifest(tiny_copy, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(ArtifactError, match=f"expected format {FORMAT_VERSION}, found {FORMAT_VERSION + 1}"):
        mxc.runtime.load(tiny_copy)
    done = run_mxc(base, "inspect", str(tiny_copy))
    assert done.returncode == 1 and "upgrade mxc" in done.stderr


def test_a_manifest_naming_another_topology_is_refused(tiny_copy, base, no_deserialising):
    import mxc.runtime

    def to_v5e(manifest):
        manifest["topology"].update(name="v5e-8", platform="tpu", chip="v5e", device_kind="TPU v5 lite")

    rewrite_manifest(tiny_copy, to_v5e)
    with pytest.raises(ArtifactError) as refused:
        mxc.runtime.load(tiny_copy)
    message = str(refused.value)
    assert "compiled for v5e-8" in message
    assert "expected tpu devices of kind 'TPU v5 lite', found cpu devices of kind 'cpu'" in message
    done = run_mxc(base, "inspect", str(tiny_copy), "--check")
    assert done.returncode == 1 and "compiled for v5e-8" in done.stderr


def test_too_few_devices_are_refused(tiny, no_deserialising):
    import jax
    import mxc.runtime

    with pytest.raises(ArtifactError, match="expected 8 devices, found 1"):
        mxc.runtime.load(tiny, devices=jax.devices("cpu")[:1])


def test_a_v5p_artifact_is_refused_on_this_cpu_host(base, no_deserialising):
    import mxc.runtime

    artifact = built(base, TINY_V5P8)
    with pytest.raises(ArtifactError) as refused:
        mxc.runtime.load(artifact)
    message = str(refused.value)
    assert "compiled for v5p-8" in message and "expected tpu devices of kind 'TPU v5'" in message
    assert "found cpu devices" in message
    done = run_mxc(base, "inspect", str(artifact), "--check")
    assert done.returncode == 1
    assert "mxc: error: this artifact was compiled for v5p-8" in done.stderr


def test_an_unlisted_or_missing_file_is_refused(tiny_copy, no_deserialising):
    from mxc.runtime.artifact_reader import read_verified

    (tiny_copy / "notes.txt").write_text("hello")
    with pytest.raises(ArtifactError, match="does not list"):
        read_verified(tiny_copy)
    (tiny_copy / "notes.txt").unlink()
    (tiny_copy / "decode.stablehlo").unlink()
    with pytest.raises(ArtifactError, match="expected decode.stablehlo, found no such file"):
        read_verified(tiny_copy)


def test_a_directory_without_manifest_is_not_an_artifact(tmp_path):
    import mxc.runtime

    with pytest.raises(ArtifactError, match="is not an mxc artifact"):
        mxc.runtime.load(tmp_path)


# ------------------------------------------------------------------ pieces

def test_tree_paths_round_trip():
    from mxc.runtime.tree_paths import TreePathError, build_tree, lookup

    paths = [["a", 0], ["a", 1], ["b", "c"], ["d", 1], ["d", 2]]
    tree = build_tree(paths, [1, 2, 3, 4, 5])
    assert tree == {"a": [1, 2], "b": {"c": 3}, "d": {1: 4, 2: 5}}  # index 0 held no arrays
    assert [lookup(tree, p) for p in paths] == [1, 2, 3, 4, 5]
    with pytest.raises(TreePathError, match=r"a has no entry 5 \(needed for a\[5\]\)"):
        lookup(tree, ["a", 5])


def test_manifest_of_the_tiny_artifact_parses_without_the_compiler(tiny):
    done = subprocess.run(child("read_manifest", str(tiny)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu-8 ['decode', 'eval_step', 'init', 'prefill', 'train_step'] []"
