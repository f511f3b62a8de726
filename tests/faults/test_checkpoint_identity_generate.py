"""`mxc generate ARTIFACT --params CKPT` refuses a run checkpoint trained with another spec in one
`mxc: error:` line naming both models, before any array of it is read. Compiles a tiny artifact."""

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from runtime_support import MXC, PROMPT_LEN, compile_tiny, cpu_env

from mxc.runtime.checkpoint import Checkpoints


@pytest.mark.slow
def test_generate_refuses_a_checkpoint_of_another_spec(tmp_path):
    artifact = compile_tiny(tmp_path / "artifact")
    manifest = json.loads((artifact / "manifest.json").read_text())
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=None, async_save=False)
    checkpoints.save(3, params={"table": jnp.zeros((4, 4))}, optimizer={"step": jnp.int32(3)},
                     meta={"step": 3, "artifact": {"model": "qwen2.5-tiny", "spec_hash": "9b1c" * 16}})
    checkpoints.close()
    np.save(tmp_path / "prompts.npy", np.ones((1, PROMPT_LEN), np.int32))
    done = subprocess.run([MXC, "generate", str(artifact), "--params", str(tmp_path / "ckpt"), "--prompt-tokens",
                           str(tmp_path / "prompts.npy"), "--max-new", "2", "-o", str(tmp_path / "out.npy")],
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"mxc: error: checkpoint {tmp_path / 'ckpt'} step 3 was trained with qwen2.5-tiny (spec 9b1c9b1c9b1c…), "
        f"this artifact is {manifest['model']} (spec {manifest['spec_hash'][:12]}…): the model specs differ")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.npy").exists()
