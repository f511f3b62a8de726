"""The golden files (tests/golden/): every zoo model's resolved IR and the analytic planner's plan
for every seeded MaxText recipe, as sorted, indented JSON. test_golden compares them with what
the code produces now; scripts/update_golden.py rewrites them, so every change shows as a diff."""

import json
from pathlib import Path

from test_plan import RECIPES  # MaxText's seeded recipes (docs/plans.md)

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_COMMAND = "ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python scripts/update_golden.py"


def _text(data) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def ir_text(name: str) -> str:
    from mxc.spec import load_model

    return _text(load_model(name).model_dump(mode="json"))


def plan_text(model: str, topology: str, slices: int, seq: int, batch: int) -> str:
    """The planner's choice without compiling (verify=False): fast, and a pure function of the
    spec, the topology and the cost model."""
    from mxc.compiler.plan import plan
    from mxc.compiler.topology import parse
    from mxc.spec import load_model

    return _text(plan(load_model(model), parse(topology, slices), seq=seq, batch=batch, verify=False).to_json())


def golden_files() -> dict[str, callable]:
    """Each golden file's path under tests/golden/ -> what produces its text now."""
    from mxc.spec import zoo_names

    files = {f"ir/{name}.json": (lambda name=name: ir_text(name)) for name in zoo_names()}
    for entry in RECIPES:
        recipe = tuple(getattr(entry, "values", entry))  # a pytest.param (marked) or a plain tuple
        model, topology, slices, seq, batch = recipe
        files[f"plans/{model}_{topology}x{slices}_seq{seq}_batch{batch}.json"] = (
            lambda recipe=recipe: plan_text(*recipe))
    return files


def stored_files() -> set[str]:
    return {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.json")}
