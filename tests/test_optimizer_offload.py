"""AdamW's moments kept in host memory between steps (LoweringChoices.optimizer_state_on_host,
MaxText's optimizer_memory_host_offload): the compiled train step takes and returns them in
pinned_host memory, and its losses and parameters equal the plain program's.

The CPU backend has a pinned_host memory space (host and device memory being the same RAM
there), so the program runs here; a TPU compile of the same lowering is in docs/plans.md."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.optimizer import OptimizerConfig
from mxc.compiler.lower.sharding import named_sharding, use_rules
from mxc.compiler.lower.train import (batch_from_sequences, init_train_state, make_train_step,
                                      train_state_shardings)
from mxc.spec.load import load_model

RULES = {"batch": ("data", "fsdp"), "embed": ("fsdp",)}
STEPS = 3


def _run(on_host: bool):
    """Losses, final state and the compiled step of STEPS train steps of llama3-tiny."""
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    config = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10)
    choices = dataclasses.replace(LoweringChoices.for_platform("cpu"), optimizer_state_on_host=on_host)
    sequences = jax.random.randint(jax.random.key(1), (4, 33), 0, spec.vocab)
    batch = batch_from_sequences(sequences)
    state_shardings = train_state_shardings(spec, config, mesh, RULES, moments_on_host=on_host)
    batch_shardings = jax.tree.map(lambda _: named_sharding(("batch", "seq"), mesh, RULES), batch)
    step = make_train_step(spec, config, microbatches=2, remat="full")

    def traced(state, batch):
        with use_lowering(choices):
            return step(state, batch)

    with use_rules(mesh, RULES):
        compiled = jax.jit(traced, in_shardings=(state_shardings, batch_shardings),
                           out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
                           donate_argnums=(0,)).lower(
            jax.eval_shape(lambda: init_train_state(spec, config, jax.random.key(0))), batch).compile()
        state = jax.device_put(init_train_state(spec, config, jax.random.key(0)), state_shardings)
        losses = []
        for _ in range(STEPS):
            state, metrics = compiled(state, jax.device_put(batch, batch_shardings))
            losses.append(float(metrics["loss"]))
    return losses, state, compiled


@pytest.fixture(scope="module")
def runs():
    return _run(False), _run(True)


def test_offloaded_moments_train_as_the_plain_program(runs):
    (plain_losses, plain, _), (losses, state, _) = runs
    # The same elementwise update, the stacked layers' inside a loop over the layers, where XLA
    # fuses it differently: equal within float32 rounding (measured: at most 6.5e-9 apart, on
    # values of about 0.01-0.05), not to the bit.
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    for tree in ("params", "opt_state"):
        flat = jax.tree_util.tree_leaves_with_path(getattr(state, tree))
        for (path, got), want in zip(flat, jax.tree.leaves(getattr(plain, tree))):
            scale = float(np.max(np.abs(np.asarray(want))))
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * scale,
                                       err_msg=tree + jax.tree_util.keystr(path))


def test_the_compiled_step_keeps_the_moments_in_host_memory(runs):
    (_, plain_state, plain), (_, state, compiled) = runs
    params = len(jax.tree.leaves(state.params))
    (state_in, _), _ = compiled.input_shardings
    state_out, _ = compiled.output_shardings
    for shardings in (state_in, state_out):
        kinds = [s.memory_kind for s in jax.tree.leaves(shardings.opt_state)]
        assert kinds.count("pinned_host") == 2 * params  # AdamW's two moments of every parameter
        assert {s.memory_kind for s in jax.tree.leaves(shardings.params)} == {"device"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {"pinned_host"}
    # XLA's entry layout marks host-memory arrays with memory space S(5): the moments in and out.
    entry = compiled.as_text().split("entry_computation_layout={", 1)[1].split("}\n", 1)[0]
    assert entry.count("S(5)") == 2 * 2 * params
    assert "S(5)" not in plain.as_text().split("entry_computation_layout={", 1)[1].split("}\n", 1)[0]
    assert all(leaf.sharding.memory_kind == "device" for leaf in jax.tree.leaves(plain_state.opt_state))


@pytest.mark.slow
def test_checkpoints_restore_across_the_two_placements(tmp_path):
    """An artifact whose plan keeps the moments on host trains (the runtime places them in host
    memory), and a checkpoint written by either artifact resumes in the other: the train state
    is the same arrays wherever the plan keeps them. Two cpu-1 compiles: minutes under load."""
    import json
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from artifact_builds import run_mxc

    def ok(*args):
        done = run_mxc(tmp_path, *args)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    ok("tokenize", str(Path(__file__).parents[1] / "README.md"), "-o", str(tmp_path / "tokens.bin"))
    ok("plan", "llama3-tiny", "--topology", "cpu-1", "--seq", "32", "--batch", "4", "--no-verify",
       "-o", str(tmp_path / "plain.json"))
    plan = json.loads((tmp_path / "plain.json").read_text())
    plan["lowering"]["optimizer_state_on_host"] = True
    (tmp_path / "host.json").write_text(json.dumps(plan))
    for name in ("plain", "host"):
        ok("compile", "llama3-tiny", "--topology", "cpu-1", "--plan", str(tmp_path / f"{name}.json"),
           "-o", str(tmp_path / name))
    manifest = (tmp_path / "host" / "manifest.json").read_text()
    assert manifest.count('"pinned_host"') == 3 * 24  # the moments: init's outputs, the train step's in and out
    assert "pinned_host" not in (tmp_path / "plain" / "manifest.json").read_text()

    def run(artifact, steps, ckpt):
        out = ok("run", str(tmp_path / artifact), "--data", str(tmp_path / "tokens.bin"), "--steps", str(steps),
                 "--ckpt-dir", str(tmp_path / ckpt))
        return float(re.search(r"done: step \d+, loss ([\d.]+)", out).group(1))

    run("host", 3, "written_on_host")
    run("plain", 3, "written_on_device")
    assert run("plain", 5, "written_on_host") == run("host", 5, "written_on_device")
