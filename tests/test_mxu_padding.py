"""Flash attention's matmuls as long as the MXUs take to run them: a head dimension is padded to
a multiple of the MXU's side (256 on v6e, 128 before), in the compiled program's estimate and the
search's formula alike (docs/plans.md, "Calibration")."""

import dataclasses

import pytest

from mxc.compiler.plan.cost import attention_mxu_factor, executed_flops_per_token
from mxc.compiler.topology import CHIPS, parse
from mxc.spec import load_model


def _attention(model: str):
    spec = load_model(model)
    return spec.blocks[spec.layer_kinds[0]].attention


@pytest.mark.parametrize("model, chip, factor", [
    ("llama3.1-8b", "v6e", 2.0),  # head_dim 128 fills half of a 256-wide MXU
    ("llama3.1-8b", "v5p", 1.0),
    ("llama3.1-8b", "v5e", 1.0),
    ("gemma3-12b", "v6e", 1.0),  # head_dim 256
    # MLA: query/key heads of 192 in two 128-wide passes (4 of the 7 passes), values of 128
    ("deepseek3-671b", "v5p", (4 * 256 + 3 * 128) / (4 * 192 + 3 * 128)),
    ("llama3.1-8b", "h100", 1.0),  # no systolic array modelled
])
def test_the_head_dimension_is_padded_to_the_mxu(model, chip, factor):
    assert attention_mxu_factor(_attention(model), CHIPS[chip]) == pytest.approx(factor)


def test_the_formula_charges_the_padded_passes_on_v6e_only():
    from mxc.compiler.analysis import attention_flops_per_token
    from mxc.compiler.plan.candidates import choices
    from mxc.compiler.plan.layout import parameters

    spec = load_model("llama3.1-8b")
    v6e = next(choices(spec, parameters(spec), parse("v6e-8"), 8192, 8, {"fsdp": 8}, "full", 1))
    assert v6e.attention.startswith("splash")
    # The same choice on a chip with v6e's figures but a 128-wide MXU.
    narrow = dataclasses.replace(v6e.topology.chip, mxu_width=128)
    v6e_narrow = dataclasses.replace(v6e, topology=dataclasses.replace(v6e.topology, chip=narrow))
    extra = executed_flops_per_token(v6e)[1] - executed_flops_per_token(v6e_narrow)[1]
    core = attention_flops_per_token(spec.blocks[spec.layer_kinds[0]].attention, 8192)
    # every layer's passes once padded, a third more where full remat replays the forward
    assert extra == pytest.approx(len(spec.layer_kinds) * core * (1 + 1 / 3))
