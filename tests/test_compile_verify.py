"""The planner verifies the very train step that `mxc compile` writes: one builder and one
lowering (mxc.compiler.aot) for both, compiled with the same options. Before, the planner built
its own train step (a jit over the state tree, the batch sharded differently)."""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from mxc.compiler.aot import RunConfig, compile_artifact, lower_function, model_functions
from mxc.compiler.plan import plan
from mxc.compiler.plan.verify import lower_train_step, plan_mesh, verify
from mxc.compiler.topology import devices, parse
from mxc.spec.load import load_model


def test_the_planner_verifies_the_train_step_compile_writes():
    spec, topology = load_model("llama3-tiny"), parse("v5p-8")
    chosen = plan(spec, topology, seq=64, batch=16, pins={"fsdp": 4}, verify=False)
    run = RunConfig(seq=64, batch=16, functions=("train_step",))
    mesh = plan_mesh(chosen, topology, devices(topology))

    planners, _, _ = lower_train_step(spec, chosen, mesh)
    compiles = next(f for f in model_functions(spec, chosen, mesh, run) if f.name == "train_step")
    assert planners.as_text() == lower_function(compiles, mesh, chosen.rules_tuples()).lowered.as_text()

    # And what XLA says of each: the verdict's memory is the artifact's.
    verdict = verify(spec, chosen, topology)
    written = compile_artifact(spec, topology, run, chosen).manifest.functions["train_step"].memory
    assert verdict.status == "fits", verdict.reason
    xla = verdict.memory
    assert xla.temporaries == written.temp_bytes
    assert xla.parameters + xla.optimizer_state + xla.batch == written.argument_bytes
    assert xla.generated_code == written.generated_code_bytes
