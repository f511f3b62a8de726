"""The runtime side of artifacts: a tiny model compiled for cpu-8 is loaded in a second process by
mxc.runtime alone and its results equal a jit of the same functions; every kind of mismatch is
refused, with what was expected and what was found, before anything is deserialised."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from artifact_builds import FAST_CPU_FLAGS, TINY_CPU8, TINY_V5P8, built, clean_env, rewrite_manifest, run_mxc
from mxc.runtime.artifact import ArtifactError, FORMAT_VERSION


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


# The second process: the artifact's functions through mxc.runtime, then the same functions
# jitted from the zoo's spec with the default plan, on the same 8 devices, compared leaf by leaf.
SECOND_PROCESS = r"""
import json, sys, warnings
import numpy as np
import jax

import mxc.runtime

artifact, recompile_copy = sys.argv[1], sys.argv[2]
program = mxc.runtime.load(artifact)
rng = np.random.default_rng(0)
sequences = rng.integers(0, 512, (8, 33))
mask = (rng.random((8, 32)) < 0.9).astype(np.float32)
batch = {"inputs": sequences[:, :-1], "targets": sequences[:, 1:], "mask": mask}
prompt = sequences[:, :16]

def run(program):
    state = program.init(3)
    first = jax.tree.map(np.asarray, state)
    evaluated = program.eval_step(state["params"], batch)
    state, metrics = program.train_step(state, batch)
    logits, cache = program.prefill(state["params"], prompt, np.full(8, 16, np.int32))  # every row 16 tokens
    step_logits, cache = program.decode(state["params"], np.argmax(np.asarray(logits), -1), cache)
    return jax.tree.map(np.asarray, {"init": first, "eval": evaluated, "state": state, "metrics": metrics,
                                     "prefill": logits, "decode": step_logits, "index": cache["index"]})

native = run(program)
forbidden = sorted(m for m in sys.modules if m.startswith(("mxc.spec", "mxc.compiler", "lark")))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    recompiled = run(mxc.runtime.load(recompile_copy))
warned = [str(w.message) for w in caught if issubclass(w.category, mxc.runtime.RecompiledWarning)]

# The reference: jit of the same functions, built here from the zoo (this process may import the
# compiler now that the runtime's imports were recorded).
import jax.numpy as jnp
from jax.sharding import Mesh
from mxc.compiler.lower.decode import decode_step, init_cache, prefill
from mxc.compiler.lower.optimizer import OptimizerConfig
from mxc.compiler.lower.sharding import named_sharding, use_rules
from mxc.compiler.lower.train import init_train_state, make_eval_step, make_train_step, train_state_shardings
from mxc.spec.load import load_model

spec = load_model("llama3-tiny")
plan = program.manifest.plan  # the plan the artifact was compiled with: the same layout, the same sums
rules = {axis: tuple(mesh_axes) for axis, mesh_axes in plan["rules"].items()}
mesh = Mesh(np.array(jax.devices()[:8]).reshape(tuple(plan["mesh"].values())), tuple(plan["mesh"]))
opt = OptimizerConfig()
with use_rules(mesh, rules):
    shardings = train_state_shardings(spec, opt, mesh, rules)
    tokens = named_sharding(("batch", "seq"), mesh, rules)
    batch_shardings = {k: tokens for k in batch}
    state = jax.jit(lambda s: init_train_state(spec, opt, jax.random.key(s)), out_shardings=shardings)(np.int32(3))
    first = jax.tree.map(np.asarray, state)
    evaluated = jax.jit(make_eval_step(spec), in_shardings=(shardings.params, batch_shardings))(state.params, batch)
    step = make_train_step(spec, opt, microbatches=plan["microbatches"], remat=plan["remat"])
    state, metrics = jax.jit(step, in_shardings=(shardings, batch_shardings))(state, batch)
    logits, cache = jax.jit(lambda p, t: prefill(spec, p, t, init_cache(spec, 8, 32)))(state.params, prompt)
    step_logits, cache = jax.jit(lambda p, t, c: decode_step(spec, p, t, c))(
        state.params, jnp.argmax(logits, -1).astype(jnp.int32), cache)
reference = jax.tree.map(np.asarray, {"init": first, "eval": evaluated, "state": state, "metrics": metrics,
                                      "prefill": logits, "decode": step_logits, "index": cache["index"]})

def entry(key):
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)

def flat(tree):
    return {"/".join(entry(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

def compare(result, expected):
    result, expected = flat(result), flat(expected)
    assert result.keys() == expected.keys(), sorted(set(result) ^ set(expected))
    unequal = {k: float(np.max(np.abs(result[k].astype(np.float64) - expected[k].astype(np.float64))))
               for k in result if not np.array_equal(result[k], expected[k])}
    return {"leaves": len(result), "unequal": unequal}

print(json.dumps({"forbidden": forbidden, "warned": warned, "native": compare(native, reference),
                  "recompiled": compare(recompiled, reference),
                  "loss": float(native["metrics"]["loss"]), "index": int(native["index"])}))
"""


def test_second_process_loads_it_and_matches_jit(tiny, base, tmp_path):
    recompile_copy = tmp_path / "other-versions"
    shutil.copytree(tiny, recompile_copy)
    # Other library versions, and a compiler option this compiler does not have (as a newer
    # compiler may have dropped one): recompiled from StableHLO without it, and said so.
    rewrite_manifest(recompile_copy, lambda m: (m["versions"].update(jaxlib="0.0.1"),
                                                m.update(compiler_options={"xla_no_such_option": True})))
    env = clean_env(base, JAX_PLATFORMS="cpu",
                    XLA_FLAGS=f"{FAST_CPU_FLAGS} --xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tiny), str(recompile_copy)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
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
    code = ("import sys; from mxc.runtime.artifact_reader import read_verified; "
            f"m = read_verified({str(tiny)!r}).manifest; "
            "print(m.topology.name, sorted(m.functions), "
            "sorted(x for x in sys.modules if x.startswith(('mxc.spec', 'mxc.compiler', 'lark', 'jax'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu-8 ['decode', 'eval_step', 'init', 'prefill', 'train_step'] []"
