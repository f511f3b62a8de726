"""MLA's low-rank widths (q_lora, kv_lora) split like embed in the planner's rules, as in
MaxText's: DeepSeek V3's q_b and kv_b, left whole on every device, held 13.5 GB of float32
weights and 27 GB of AdamW moments a device on v5p-1024 (docs/plans.md). Models without them keep
the default rules."""

from __future__ import annotations

from mxc.compiler.plan.layout import parameters, shard_counts
from mxc.compiler.plan.plan import MESH_AXES
from mxc.compiler.plan.rules import DEFAULT_RULES, make_rules
from mxc.spec.load import load_models


def _rules(name: str, fsdp: int):
    spec = next(iter(load_models(name).values()))
    params = parameters(spec)
    mesh = {axis: 1 for axis in MESH_AXES} | {"fsdp": fsdp}
    return params, mesh, make_rules(mesh, params.tensors)[0]


def test_deepseek_low_rank_weights_split_over_fsdp():
    params, mesh, rules = _rules("deepseek3-671b", 512)
    assert rules["q_lora"] == rules["kv_lora"] == DEFAULT_RULES["embed"]
    low_rank = [t for t in params.tensors if t.axes and t.axes[-3:-2] in (("q_lora",), ("kv_lora",))]
    assert low_rank, "q_b and kv_b"
    for tensor in low_rank:
        assert 512 in shard_counts(tensor.axes, rules, mesh), tensor.path


def test_models_without_low_rank_widths_keep_the_default_rules():
    _, _, rules = _rules("llama3.1-8b", 8)
    assert set(rules) == set(DEFAULT_RULES)
