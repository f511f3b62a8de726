"""`mxc compile` and `mxc inspect`: the manifest's keys and figures against independent counts,
atomic writes and --force, the compile cache, TPU and GPU targets, compile time under scan."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from artifact_builds import FAST_CPU_FLAGS, TINY_CPU8, TINY_V5P8, built, child_report, clean_env, run_mxc
from mxc.runtime.artifact import FORMAT_VERSION


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def tiny(base) -> Path:
    return built(base, TINY_CPU8)


@pytest.fixture(scope="session")
def manifest(tiny) -> dict:
    return json.loads((tiny / "manifest.json").read_text())


def test_manifest_has_the_keys_scripts_rely_on(manifest):
    import jax
    import jaxlib

    assert manifest["format_version"] == FORMAT_VERSION
    topology = manifest["topology"]
    assert (topology["name"], topology["chips"], topology["devices"]) == ("cpu-8", 8, 8)
    assert topology["mesh"] == {"stage": 1, "data": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}
    assert manifest["versions"]["jax"] == jax.__version__ and manifest["versions"]["jaxlib"] == jaxlib.__version__
    assert set(manifest["versions"]) >= {"jax", "jaxlib", "libtpu", "mxc"}
    assert set(manifest["functions"]) == {"init", "train_step", "eval_step", "prefill", "decode"}
    assert [name for name in manifest["functions"] if "train" in name] == ["train_step"]
    for function in manifest["functions"].values():
        assert set(function["memory"]) >= {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                           "total_bytes"}
        memory = function["memory"]
        assert memory["total_bytes"] == (memory["argument_bytes"] + memory["output_bytes"]
                                         - memory["alias_bytes"] + memory["temp_bytes"])
        assert function["cost"]["flops"] > 0 and function["cost"]["bytes_accessed"] > 0
    assert manifest["spec"]["name"] == "llama3-tiny" and len(manifest["spec_hash"]) == 64
    assert manifest["plan"]["mesh"]["fsdp"] == 8 and manifest["plan"]["pins"] == {"fsdp": 8}
    assert manifest["plan"]["xla"]["status"] == "fits"  # judged by this compile


def test_files_lists_every_file_with_its_sha256(tiny, manifest):
    on_disk = {p.relative_to(tiny).as_posix() for p in tiny.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((tiny / name).read_bytes()).hexdigest() == digest
    # No pickle anywhere: neither file kind starts with a pickle protocol header.
    for name in on_disk:
        assert not (tiny / name).read_bytes().startswith(b"\x80"), name


def test_train_step_leaves_shardings_and_donation(manifest):
    from mxc.compiler.lower.params import param_shapes
    from mxc.spec.load import load_model

    train = manifest["functions"]["train_step"]
    assert train["arguments"] == ["state", "batch", "schedule"] and train["donation"] == [0]
    by_path = {tuple(leaf["path"]): leaf for leaf in train["inputs"]}
    # The learning rate comes in every step (mxc.runtime.schedule): a replicated float32 scalar.
    rate = by_path[(2, "learning_rate")]
    assert (rate["shape"], rate["dtype"], rate["sharding"], rate["donated"]) == ([], "float32", [], False)
    embedding = by_path[(0, "params", "embed", "embedding")]
    assert embedding["shape"] == [512, 64] and embedding["dtype"] == "float32"
    assert embedding["sharding"] == [None, "fsdp"] and embedding["donated"]
    inputs = by_path[(1, "inputs")]
    assert inputs["shape"] == [8, 32] and inputs["dtype"] == "int32"
    assert inputs["sharding"] == ["fsdp", None] and not inputs["donated"]
    # The state's leaves: the parameters three times over (weights, Adam's two moments) plus counters.
    params = len(__import__("jax").tree.leaves(param_shapes(load_model("llama3-tiny"))))
    state_leaves = [leaf for leaf in train["inputs"] if leaf["path"][0] == 0]
    assert 3 * params < len(state_leaves) <= 3 * params + 4
    outputs = {tuple(leaf["path"]) for leaf in train["outputs"]}
    assert (0, "params", "embed", "embedding") in outputs and (1, "loss") in outputs


def test_memory_analysis_against_the_parameter_count(manifest):
    """Argument bytes per device: weights and two Adam moments in float32, all split 8 ways along
    `embed` by the FSDP plan, plus the batch's share (inputs, targets, mask, segment ids,
    positions) and a few replicated scalars (counters, the step's learning rate)."""
    from mxc.compiler.analysis import summarize
    from mxc.spec.load import load_model

    params = summarize(load_model("llama3-tiny")).total_params
    state_bytes = 3 * params * 4 // 8
    batch_bytes = 5 * 8 * 32 * 4 // 8
    memory = manifest["functions"]["train_step"]["memory"]
    assert state_bytes + batch_bytes <= memory["argument_bytes"] <= state_bytes + batch_bytes + 64
    # The donated state comes back in the same buffers.
    assert state_bytes <= memory["alias_bytes"] <= state_bytes + 64


def test_estimate_is_the_analytic_flop_count(manifest):
    from mxc.compiler.analysis import summarize
    from mxc.spec.load import load_model

    estimate = manifest["estimate"]
    per_token = summarize(load_model("llama3-tiny"), 32).train_flops_per_token
    assert estimate["tokens_per_step"] == 8 * 32
    assert estimate["train_flops_per_step"] == pytest.approx(per_token * 8 * 32)
    assert estimate["flops_per_device"] == pytest.approx(per_token * 8 * 32 / 8)


def test_inspect_prints_the_summary(tiny, base):
    done = run_mxc(base, "inspect", str(tiny), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["topology"]["name"] == "cpu-8" and summary["memory"]["fits"]
    assert set(summary["functions"]) == {"init", "train_step", "eval_step", "prefill", "decode"}
    assert summary["functions"]["train_step"]["donated_arguments"] == ["state"]
    text = run_mxc(base, "inspect", str(tiny))
    assert text.returncode == 0 and "train_step" in text.stdout and "memory per device" in text.stdout


def test_inspect_shows_shapes_optimizer_and_serve_shapes(tiny, base):
    # TINY_CPU8: --seq 32 --batch 8 --serve --cache-len 32; the prompt defaults to half the cache.
    run = json.loads(run_mxc(base, "inspect", str(tiny), "--json").stdout)["run"]
    assert (run["seq"], run["batch"], run["cache_len"], run["prompt_len"]) == (32, 8, 32, 16)
    assert run["optimizer"]["learning_rate"] == 3e-4 and run["optimizer"]["weight_decay"] == 0.1
    text = " ".join(run_mxc(base, "inspect", str(tiny)).stdout.split())  # as read, whatever the wrapping
    assert "shapes: seq 32, batch 8 sequences" in text
    assert "optimizer: AdamW, lr 0.0003, warmup 1000 steps, cosine to 0.1 x by step 10000" in text
    assert "b1 0.9, b2 0.95, eps 1e-08, weight decay 0.1, clip norm 1" in text
    assert f"serve: batch {run['serve_batch']}, prompt 16, cache 32 tokens" in text


# ------------------------------------------------------------------ cache and atomic writes

def test_unchanged_model_comes_from_the_compile_cache(tiny, base, tmp_path):
    started = time.perf_counter()
    done = run_mxc(base, "compile", *TINY_CPU8, "-o", str(tmp_path / "again"), "--json")
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["cached"] is True
    # Inside the command: no compile at all ("cached" above is the check; this bounds the time a
    # loaded machine may add to reading the artifact back).
    assert summary["seconds"] < 10, summary["seconds"]
    assert elapsed < 30  # with the interpreter's start-up, on a loaded machine
    assert (tmp_path / "again" / "manifest.json").read_bytes() == (tiny / "manifest.json").read_bytes()


def test_a_different_shape_misses_the_cache(base, tmp_path):
    from mxc.compiler.aot import RunConfig
    from mxc.compiler.compile_cache import cache_key

    spec, plan, topology = {"name": "m"}, {"mesh": {"fsdp": 8}}, {"name": "cpu-8"}
    first = cache_key(spec, plan, topology, RunConfig(seq=32, batch=8).to_json())
    assert first == cache_key(spec, plan, topology, RunConfig(seq=32, batch=8).to_json())
    assert first != cache_key(spec, plan, topology, RunConfig(seq=32, batch=16).to_json())
    assert first != cache_key(spec, {"mesh": {"fsdp": 4, "data": 2}}, topology, RunConfig(seq=32, batch=8).to_json())
    assert first != cache_key({"name": "m", "vocab": 1}, plan, topology, RunConfig(seq=32, batch=8).to_json())


def test_an_existing_artifact_is_replaced_only_with_force(tiny, base, tmp_path):
    output = tmp_path / "out"
    assert run_mxc(base, "compile", *TINY_CPU8, "-o", str(output)).returncode == 0
    before = (output / "manifest.json").stat().st_mtime_ns
    refused = run_mxc(base, "compile", *TINY_CPU8, "-o", str(output))
    assert refused.returncode == 1
    assert f"{output} already exists; pass --force to replace it" in refused.stderr
    assert (output / "manifest.json").stat().st_mtime_ns == before
    replaced = run_mxc(base, "compile", *TINY_CPU8, "-o", str(output), "--force")
    assert replaced.returncode == 0, replaced.stderr
    assert (output / "manifest.json").stat().st_mtime_ns != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or retired directories


def test_force_never_replaces_a_directory_that_is_not_an_artifact(base, tmp_path):
    output = tmp_path / "precious"
    output.mkdir()
    (output / "thesis.tex").write_text("years of work")
    done = run_mxc(base, "compile", *TINY_CPU8, "-o", str(output), "--force")
    assert done.returncode == 1 and "is not an mxc artifact" in done.stderr
    assert (output / "thesis.tex").read_text() == "years of work"


def test_a_failed_write_leaves_the_destination_as_it_was(tiny, tmp_path):
    from mxc.compiler.artifact_writer import write_artifact
    from mxc.runtime.artifact_reader import read_verified

    verified = read_verified(tiny)
    destination = tmp_path / "artifact"
    write_artifact(destination, verified.manifest, dict(verified.contents))
    original = {p.name: p.read_bytes() for p in destination.iterdir()}
    broken = dict(verified.contents)
    broken["zz-last.bin"] = None  # not bytes: the write fails midway through the files
    with pytest.raises(TypeError):
        write_artifact(destination, verified.manifest, broken, force=True)
    assert {p.name: p.read_bytes() for p in destination.iterdir()} == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]
    read_verified(destination)


# ------------------------------------------------------------------ targets and options

def test_tpu_target_compiles_on_this_cpu_host(base):
    artifact = built(base, TINY_V5P8)
    manifest = json.loads((artifact / "manifest.json").read_text())
    topology = manifest["topology"]
    assert (topology["platform"], topology["device_kind"], topology["chips"], topology["devices"]) == \
        ("tpu", "TPU v5", 4, 4)
    assert topology["shape"] == [2, 2, 1] and len(topology["device_coords"]) == 4
    assert manifest["versions"]["libtpu"]
    assert manifest["compiler_options"] == {  # xla_options.py: a dense model, no tensor axis
        "xla_tpu_offload_gather_to_sparsecore": False, "xla_jf_spmd_threshold_for_windowed_einsum_mib": 1000000}
    shown = run_mxc(base, "inspect", str(artifact))
    assert shown.returncode == 0 and "compiler options: xla_tpu_offload_gather_to_sparsecore=False" in shown.stdout
    train = manifest["functions"]["train_step"]["memory"]
    assert 0 < train["total_bytes"] < 95 * 2**30
    assert manifest["functions"]["train_step"]["cost"]["flops"] > 0


def test_a_tpu_compile_runs_nothing_on_the_host(base, tmp_path):
    """Exactly one XLA compile per function (init, train_step, eval_step), all for the TPU:
    building the abstract state must not compile or run anything on the host's CPU backend,
    whose code generator would cost the compile command memory it does not need."""
    args = ["compile", "llama3-tiny", "--topology", "v5p-8", "--no-cache", "-o", str(tmp_path / "out")]
    result = child_report("count_backend_compiles", *args, env=clean_env(base), timeout=600)
    assert result == {"code": 0, "backend_compiles": 3}, result


def test_a_libtpu_flag_it_refuses_is_shown(base, tmp_path):
    """libtpu exits the process itself on a flag it does not know; its reason must reach the user."""
    done = run_mxc(base, "compile", "llama3-tiny", "--topology", "v5p-8", "-o", str(tmp_path / "out"),
                   LIBTPU_INIT_ARGS="--xla_no_such_flag=1")
    assert done.returncode == 1
    assert "Unknown command line flag 'xla_no_such_flag'" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_gpu_target_without_the_plugin_names_the_extra(base):
    from mxc.compiler.gpu_target import plugin_installed

    if plugin_installed():
        pytest.skip("the CUDA plugin is installed here")
    done = run_mxc(base, "compile", "llama3-tiny", "--topology", "h100-8", "-o", str(base / "gpu"))
    assert done.returncode == 1
    assert "needs the CUDA PJRT plugin" in done.stderr and "pip install 'mxc[gpu]'" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--topology", "cpu-8", "--seq", "1024"], "--seq 1024 exceeds llama3-tiny's max_seq of 256"),
    (["--topology", "cpu-8", "--seq", "32", "--batch", "12", "--pin", "fsdp=8"], "batch"),
    (["--topology", "v5q-8"], "unknown accelerator 'v5q'"),
    (["--topology", "cpu-8", "--seq", "0"], "--seq must be a positive number"),
    (["--topology", "cpu-8", "--plan", "/nonexistent/plan.json"], "no such plan file"),
])
def test_bad_options_are_user_errors(base, tmp_path, args, message):
    done = run_mxc(base, "compile", "llama3-tiny", *args, "-o", str(tmp_path / "out"))
    assert done.returncode == 1, done.stderr
    assert message in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_plan_for_another_topology_is_refused(base, tmp_path):
    plan = tmp_path / "plan.json"
    made = run_mxc(base, "plan", "llama3-tiny", "--topology", "cpu-4", "--seq", "32", "--batch", "8",
                   "--no-verify", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    done = run_mxc(base, "compile", "llama3-tiny", "--topology", "cpu-8", "--plan", str(plan),
                   "-o", str(tmp_path / "out"))
    assert done.returncode == 1
    assert f"{plan} is a plan for cpu-4 (4 chips), not cpu-8 (8 chips)" in done.stderr


def test_a_plan_for_another_model_is_refused(base, tmp_path):
    plan = tmp_path / "plan.json"
    made = run_mxc(base, "plan", "mla-tiny", "--topology", "cpu-8", "--seq", "32", "--batch", "8",
                   "--no-verify", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    data = json.loads(plan.read_text())
    assert data["model"] == "mla-tiny" and len(data["spec_hash"]) == 64
    compile_args = ["--topology", "cpu-8", "--plan", str(plan), "-o", str(tmp_path / "out")]
    done = run_mxc(base, "compile", "llama3-tiny", *compile_args)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{plan} is a plan for mla-tiny, not llama3-tiny" in done.stderr
    # Same name, another spec (edited since it was planned): refused too.
    plan.write_text(json.dumps({**data, "spec_hash": "0" * 64}))
    done = run_mxc(base, "compile", "mla-tiny", *compile_args)
    assert done.returncode == 1 and f"{plan} is a plan for another version of mla-tiny" in done.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ compile time under scan

def test_compile_time_does_not_grow_with_depth(base):
    """80 layers compile within 1.5x of 8: the layers are one lax.scan, not 80 copies."""
    seconds = child_report("scan_compile_seconds", "llama3-tiny", timeout=600,
                           env=clean_env(base, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_CPU_FLAGS))
    assert seconds["80"] <= 1.5 * seconds["8"], seconds


# ------------------------------------------------------------------ the real thing

@pytest.mark.slow
def test_llama3_8b_on_v5p_1024_fits(base, tmp_path):
    """The issue's acceptance run: MaxText's recipe (4 x 4096 per chip), 512 v5p chips."""
    output = tmp_path / "llama3.1-8b-v5p-1024"
    done = run_mxc(base, "compile", "llama3.1-8b", "--topology", "v5p-1024", "-o", str(output), "--json",
                   "--no-cache", timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["topology"]["devices"] == 512 and summary["run"]["batch"] == 2048
    assert summary["run"]["seq"] == 4096
    assert summary["memory"]["fits"], summary["memory"]
    assert 0 < summary["memory"]["peak_bytes_per_device"] <= 95 * 2**30
