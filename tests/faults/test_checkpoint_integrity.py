"""A checkpoint with a flipped bit or a missing item is never restored silently (issue 22): every
array's checksum is recorded with its step and checked when the step is read back; the error
names the step, and `mxc run --fallback` takes the newest intact step instead."""

import os
import shutil

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.runtime.checkpoint import CheckpointError, Checkpoints, restore_params
from mxc.runtime.checksums import checksums


def _trees(offset=0.0):
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.normal(size=(64, 32)) + offset, jnp.float32),
              "scale": jnp.asarray(rng.normal(size=(32,)), jnp.bfloat16)}
    optimizer = {"step": jnp.asarray(7, jnp.int32), "mu": jax.tree.map(jnp.zeros_like, params)}
    return params, optimizer


def _save(directory, steps=(1, 2)):
    checkpoints = Checkpoints(directory, keep=None, async_save=False)
    for step in steps:
        params, optimizer = _trees(step)
        checkpoints.save(step, params=params, optimizer=optimizer, meta={"step": step, "data": {}})
    checkpoints.close()


def _restore(directory, step):
    params, optimizer = _trees()
    checkpoints = Checkpoints(directory, keep=None)
    try:
        return checkpoints.restore(step, params_target=params, optimizer_target=optimizer)
    finally:
        checkpoints.close()


def _stored_files(step_dir):
    return sorted(p for item in ("params", "optimizer") for p in (step_dir / item).rglob("*")
                  if p.is_file() and p.name != "commit_success.txt")


def test_any_single_flipped_bit_changes_a_checksum():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 7)), jnp.float32)
    base = checksums({"x": x})["['x']"]
    raw = np.asarray(x).view(np.uint32).copy()
    for index in [(0, 0), (2, 3), (4, 6)]:
        for bit in (0, 13, 31):
            flipped = raw.copy()
            flipped[index] ^= np.uint32(1 << bit)
            assert checksums({"x": jnp.asarray(flipped.view(np.float32))})["['x']"] != base
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in other places
    assert checksums({"x": jnp.asarray(swapped)})["['x']"] != base


def test_a_checksum_does_not_depend_on_the_sharding():
    devices = jax.devices()
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    mesh = jax.sharding.Mesh(np.array(devices[:len(devices) // 2 * 2 or 1]).reshape(-1), ("d",))
    spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    assert checksums({"x": spread}) == checksums({"x": x})


def test_a_flipped_bit_in_any_stored_file_is_refused_or_harmless(tmp_path):
    """Every file of a step, a bit flipped at several places: the restore either refuses, naming
    the step, or gives exactly the saved values (a byte nothing reads); never other values."""
    directory = tmp_path / "ckpt"
    _save(directory)
    saved_params, saved_optimizer = _trees(2)
    files = _stored_files(directory / "2")
    refused_by_checksum = 0
    for path in files:
        original = path.read_bytes()
        for position in sorted({0, len(original) // 3, len(original) // 2, len(original) - 1}):
            damaged = bytearray(original)
            damaged[position] ^= 0x10
            path.write_bytes(bytes(damaged))
            try:
                params, optimizer, _ = _restore(directory, 2)
            except CheckpointError as err:
                assert "step 2" in str(err) and len(str(err)) < 600
                refused_by_checksum += "is corrupt" in str(err)
            else:
                for got, want in zip(jax.tree.leaves((params, optimizer)), jax.tree.leaves((saved_params, saved_optimizer))):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{path} @ {position}")
        path.write_bytes(original)
    assert refused_by_checksum > 0  # flips the file format itself does not notice
    params, _, meta = _restore(directory, 2)  # intact again
    np.testing.assert_array_equal(np.asarray(params["kernel"]), np.asarray(saved_params["kernel"]))
    assert meta == {"step": 2, "data": {}}


def test_a_corrupt_value_with_a_valid_file_is_refused(tmp_path):
    """A bit flipped before the bytes were written (or rewritten consistently): the file reads,
    the value is wrong, and only the checksum can tell."""
    directory = tmp_path / "ckpt"
    checkpoints = Checkpoints(directory, keep=None, async_save=False)
    params, optimizer = _trees()
    checkpoints.save(1, params=params, optimizer=optimizer, meta={"step": 1, "data": {}})
    checkpoints.close()
    good = Checkpoints(directory, keep=None, async_save=False)
    bad_params = {**params, "kernel": params["kernel"].at[3, 4].set(3.7e31)}
    recorded = checksums(params)
    # Save the damaged values under the intact values' checksums, as a disk flip after hashing would.
    import mxc.runtime.checkpoint as checkpoint_module
    real = checkpoint_module.checksums
    checkpoint_module.checksums = lambda tree: recorded if tree is bad_params else real(tree)
    try:
        good.save(2, params=bad_params, optimizer=optimizer, meta={"step": 2, "data": {}})
    finally:
        checkpoint_module.checksums = real
        good.close()
    with pytest.raises(CheckpointError, match=r"step 2 is corrupt: params \['kernel'\]"):
        _restore(directory, 2)
    with pytest.raises(CheckpointError, match=r"step 2 is corrupt"):
        restore_params(directory, params)
    _restore(directory, 1)


def test_a_missing_item_is_one_error_naming_the_step(tmp_path):
    directory = tmp_path / "ckpt"
    _save(directory)
    shutil.rmtree(directory / "2" / "optimizer")
    with pytest.raises(CheckpointError, match=r"step 2 cannot be read") as caught:
        _restore(directory, 2)
    assert len(str(caught.value)) < 500
