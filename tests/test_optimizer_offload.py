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
    # The same update in the same order on the same values: equal to the bit.
    assert losses == plain_losses
    assert losses[-1] < losses[0]
    for want, got in zip(jax.tree.leaves(plain.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for want, got in zip(jax.tree.leaves(plain.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


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
