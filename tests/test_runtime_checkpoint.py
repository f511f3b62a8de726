"""Checkpoints: round trip of parameters, optimizer state, step and metadata; keeping the last M;
a crash in the middle of a save; restoring onto another mesh and another device count."""

import os
import signal
import subprocess
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mxc.runtime.checkpoint import LOCK_FILE, CheckpointError, Checkpoints, abstract_like, find_checkpoint, restore_params

from runtime_support import child, cpu_env


def _state(seed=0):
    rng = np.random.default_rng(seed)
    params = {"embed": {"embedding": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)},
              "segments": [[{"scale": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)}]]}
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # non-trivial moments
    return params, {"step": jnp.asarray(3, jnp.int32), "opt_state": opt_state}


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_and_only_the_newest_are_kept(tmp_path):
    params, optimizer = _state()
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, params=jax.tree.map(lambda x: x + step, params), optimizer=optimizer,
                         meta={"step": step, "data": {"consumed": 8 * step}})
    checkpoints.close()

    reopened = Checkpoints(tmp_path / "ckpt", keep=2)
    assert reopened.all_steps() == [2, 3] and reopened.latest_step() == 3
    got_params, got_optimizer, meta = reopened.restore(3, params_target=params, optimizer_target=optimizer)
    _assert_trees_equal(got_params, jax.tree.map(lambda x: x + 3, params))
    _assert_trees_equal(got_optimizer, optimizer)
    assert meta == {"step": 3, "data": {"consumed": 24}}
    reopened.close()


def test_parameters_alone_from_a_run_directory_or_a_step(tmp_path):
    params, optimizer = _state()
    checkpoints = Checkpoints(tmp_path / "ckpt")
    checkpoints.save(5, params=params, optimizer=optimizer, meta={})
    checkpoints.save(9, params=jax.tree.map(lambda x: -x, params), optimizer=optimizer, meta={})
    checkpoints.close()
    assert find_checkpoint(tmp_path / "ckpt") == ((tmp_path / "ckpt").absolute(), 9)
    _assert_trees_equal(restore_params(tmp_path / "ckpt", abstract_like(params)), jax.tree.map(lambda x: -x, params))
    _assert_trees_equal(restore_params(tmp_path / "ckpt" / "5", params), params)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)


def test_parameters_saved_by_the_hf_importer_are_read_too(tmp_path):
    from mxc.runtime.params_io import save_params

    params, _ = _state(1)
    save_params(tmp_path / "params", params)
    _assert_trees_equal(restore_params(tmp_path / "params", params), params)


def test_imported_groups_without_leaves_do_not_block_a_restore(tmp_path):
    """An imported model's weightless norms are `{}` (Llama 4's q/k norms); an artifact's target has
    no such group, and the parameters still load."""
    from mxc.runtime.params_io import load_params, save_params

    params, _ = _state(1)
    save_params(tmp_path / "params", {**params, "q_norm": {}, "inner": {"k_norm": {}}})
    _assert_trees_equal(load_params(tmp_path / "params", abstract_like(params)), params)


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "saving"
    process = subprocess.Popen(child("crash_during_save", directory, marker),
                               env=cpu_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the save never reached its commit"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    leftovers = [p.name for p in directory.iterdir() if not p.name.isdigit()]
    assert any("tmp" in name for name in leftovers), leftovers  # step 2 was half-way, uncommitted

    checkpoints = Checkpoints(directory)
    assert checkpoints.latest_step() == 1
    params, optimizer, meta = checkpoints.restore(1, params_target={"w": jnp.zeros(4)},
                                                  optimizer_target={"step": jnp.int32(0)})
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(4.0))
    assert meta == {"step": 1}
    # The resumed run saves step 2 again; the dead save's leftovers are cleared away first.
    checkpoints.save(2, params={"w": jnp.arange(4.0) * 3}, optimizer={"step": jnp.int32(2)}, meta={"step": 2})
    checkpoints.close()
    # The killed run's lock was freed by the kernel; only its (empty) lock file stays.
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_FILE, "1", "2"]
    np.testing.assert_array_equal(np.asarray(restore_params(directory, {"w": jnp.zeros(4)})["w"]), np.arange(4.0) * 3)


@pytest.fixture(scope="module")
def saved_on_eight_devices(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded") / "ckpt"
    saved = subprocess.run(child("save_sharded", directory), env=cpu_env(8),
                           capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-3000:]
    return directory


@pytest.mark.parametrize("devices", [8, 4])
def test_restore_reshards_onto_another_mesh_and_device_count(saved_on_eight_devices, devices):
    restored = subprocess.run(child("restore_elsewhere", saved_on_eight_devices),
                              env=cpu_env(devices), capture_output=True, text=True, timeout=120)
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert f"restored on {devices} devices" in restored.stdout
