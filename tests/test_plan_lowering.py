"""The plan file decides the program: the lowering's target-dependent choices (stacked
projections, Pallas kernels interpreted) are recorded in the plan and the program is traced under
them, whatever mesh traces it; plans saved before they were recorded get the choices of their
chip's platform."""

import json

import pytest

from mxc.compiler.aot import RunConfig, lower_function, model_functions
from mxc.compiler.lower.choices import LoweringChoices, lowering_choices, use_lowering
from mxc.compiler.lower.stacking import stacked_projections
from mxc.compiler.plan import plan
from mxc.compiler.plan.plan import Lowering, Plan
from mxc.compiler.plan.verify import plan_mesh
from mxc.compiler.topology import CHIPS, devices, parse
from mxc.spec.load import load_model


@pytest.mark.parametrize("topology, stacked", [("v5p-8", True), ("cpu-8", False)])
def test_the_planner_records_the_choices_of_the_target(topology, stacked):
    chosen = plan(load_model("llama3-tiny"), parse(topology), seq=64, batch=16, verify=False)
    assert chosen.lowering == Lowering(stacked_projections=stacked, interpret_kernels=not stacked)
    assert Plan.model_validate(json.loads(json.dumps(chosen.to_json()))).lowering == chosen.lowering


def test_a_plan_saved_without_choices_gets_those_of_its_chip():
    chosen = plan(load_model("llama3-tiny"), parse("v5p-8"), seq=64, batch=16, verify=False)
    old = Plan.model_validate({**chosen.to_json(), "lowering": None})
    v5p = CHIPS["v5p"]  # and megablox sizes its tiles by the chip's FLOPs per HBM byte and VMEM
    assert old.lowering_choices() == LoweringChoices(stacked_projections=True, interpret_kernels=False,
                                                     grouped_matmul="megablox", ragged_all_to_all=True,
                                                     grouped_flops_per_byte=v5p.peak_bf16_flops / v5p.hbm_bandwidth,
                                                     grouped_vmem_bytes=16 * 2**20)


def _train_step_hlo(spec, chosen, topology) -> str:
    mesh = plan_mesh(chosen, topology, devices(topology))
    run = RunConfig(seq=64, batch=16, functions=("train_step",))
    step = next(f for f in model_functions(spec, chosen, mesh, run) if f.name == "train_step")
    return lower_function(step, mesh, chosen.rules_tuples()).lowered.as_text()


def test_the_plan_not_the_tracing_mesh_decides_stacked_projections():
    spec, topology = load_model("llama3-tiny"), parse("v5p-8")
    chosen = plan(spec, topology, seq=64, batch=16, pins={"fsdp": 4}, verify=False)
    apart = chosen.model_copy(update={"lowering": Lowering(stacked_projections=False, interpret_kernels=False)})
    # A TPU mesh traces both; the plan that says apart gets the program without stacked kernels
    # (jnp.stack lowers to concatenates of the kernels, forward and backward).
    stacked_hlo, apart_hlo = _train_step_hlo(spec, chosen, topology), _train_step_hlo(spec, apart, topology)
    assert apart_hlo.count("concatenate") < stacked_hlo.count("concatenate")
    assert _train_step_hlo(spec, apart, topology) == apart_hlo  # the plan alone fixes it


def test_code_traced_without_a_plan_follows_its_platform_and_a_plan_overrides_it():
    assert lowering_choices() == LoweringChoices.for_platform("cpu")
    with use_lowering(LoweringChoices(stacked_projections=True, interpret_kernels=False)):
        assert stacked_projections() and not lowering_choices().interpret_kernels
