"""Saved checkpoints carry no absolute path of the folder they were written to (issue 22)."""
import jax.numpy as jnp

from mxc.runtime.checkpoint import Checkpoints, restore_params


def test_commit_markers_name_no_absolute_path(tmp_path):
    directory = tmp_path / "ckpt"
    checkpoints = Checkpoints(directory, keep=None)
    for step in (1, 2):
        checkpoints.save(step, params={"w": jnp.arange(4.0) * step}, optimizer={"step": jnp.int32(step)},
                         meta={"step": step})
    checkpoints.close()
    holding = [p for p in directory.rglob("*") if p.is_file() and str(tmp_path).encode() in p.read_bytes()]
    assert holding == []
    moved = tmp_path / "moved"
    directory.rename(moved)  # still a valid checkpoint after the rewrite
    assert (restore_params(moved, {"w": jnp.zeros(4)})["w"] == jnp.arange(4.0) * 2).all()
