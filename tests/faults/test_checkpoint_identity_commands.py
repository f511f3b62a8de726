"""`mxc export-hf MODEL --params CKPT` (and `mxc forward`, which loads the same way) refuses a run
checkpoint trained with another spec in one `mxc: error:` line naming both models, before any
array is read; a checkpoint of the same spec exports."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from mxc.compiler.cli import main
from mxc.compiler.hf.model_dir import load_spec
from mxc.compiler.lower.params import param_shapes
from mxc.compiler.plan.plan import spec_hash
from mxc.runtime.checkpoint import Checkpoints

MODEL = "llama3-tiny"


def _run_checkpoint(directory, spec_hash_recorded: str):
    """Step 1 of a run of MODEL's parameter shapes whose meta records `spec_hash_recorded`."""
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), param_shapes(load_spec(MODEL)))
    checkpoints = Checkpoints(directory, keep=None, async_save=False)
    checkpoints.save(1, params=params, optimizer={"step": jnp.int32(1)},
                     meta={"step": 1, "artifact": {"model": "other-tiny", "spec_hash": spec_hash_recorded}})
    checkpoints.close()


def test_export_refuses_a_checkpoint_of_another_spec_in_one_line(tmp_path, capsys):
    _run_checkpoint(tmp_path / "ckpt", "ab" * 32)
    assert main(["export-hf", MODEL, "--params", str(tmp_path / "ckpt"), "-o", str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err.strip()
    expected = spec_hash(load_spec(MODEL))[:12]
    assert err == (f"mxc: error: cannot export {MODEL}: checkpoint {tmp_path / 'ckpt'} step 1 was trained with "
                   f"other-tiny (spec abababababab…), this artifact is {MODEL} (spec {expected}…): "
                   "the model specs differ")
    assert not (tmp_path / "hf").exists()


def test_export_takes_a_checkpoint_of_the_same_spec(tmp_path):
    _run_checkpoint(tmp_path / "ckpt", spec_hash(load_spec(MODEL)))
    assert main(["export-hf", MODEL, "--params", str(tmp_path / "ckpt"), "-o", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
