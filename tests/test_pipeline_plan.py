"""Pipeline stages from plan to compiled train step: a plan with `--pin stage=N` records its
pipeline, the device mesh has the stage axis, and the train step `mxc compile` builds for it
(mxc.compiler.aot) trains with the same losses as the plan without stages; the train state keeps
the flat layer order, so one plan's state continues on the other's mesh with the same result.

The training runs on 8 virtual CPU devices in a child process started with XLA_FLAGS; this file
is also that child's script.
"""

import json

import pytest

from artifact_builds import child_report

SEQ, BATCH, MICROBATCHES, STEPS = 16, 32, 4, 3


def _plans(model: str, stages: int):
    """(plan with stages, plan without) for cpu-8, not compiled by the planner."""
    from mxc.compiler.plan import plan
    from mxc.compiler.topology import parse
    from mxc.spec.load import load_model

    spec = load_model(model).model_copy(update={"compute_dtype": "float32"})
    topology = parse("cpu-8")
    kwargs = dict(seq=SEQ, batch=BATCH, remat="full", microbatches=MICROBATCHES, verify=False)
    staged = plan(spec, topology, pins={"stage": stages, "fsdp": 8 // stages}, **kwargs)
    flat = plan(spec, topology, pins={"stage": 1, "fsdp": 8}, **kwargs)
    # The same MoE path on both (the planner takes dropless on fsdp 8, the capacity path with stages).
    flat = flat.model_copy(update={"expert_path": staged.expert_path, "capacity_factor": staged.capacity_factor})
    return spec, staged, flat


def _child(model: str) -> dict:
    import jax
    import numpy as np

    from mxc.compiler.aot import train_step_function
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.sharding import use_rules
    from mxc.compiler.lower.train import init_train_state
    from mxc.compiler.plan.verify import plan_mesh
    from mxc.compiler.topology import parse

    assert jax.device_count() == 8
    spec, staged, flat = _plans(model, 2)
    topology = parse("cpu-8")
    optimizer = OptimizerConfig()
    # One batch, seen every step, so that the loss falls.
    tokens = np.random.default_rng(0).integers(0, spec.vocab, (1, BATCH, SEQ + 1)).repeat(STEPS, axis=0)
    batches = [{"inputs": t[:, :-1].astype(np.int32), "targets": t[:, 1:].astype(np.int32),
                "mask": np.ones((BATCH, SEQ), np.float32), "segment_ids": np.zeros((BATCH, SEQ), np.int32),
                "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))} for t in tokens]
    schedule = {"learning_rate": np.float32(1e-2)}

    def runner(p):
        mesh = plan_mesh(p, topology)
        traceable = train_step_function(spec, p, mesh, optimizer)
        with use_rules(mesh, p.rules_tuples()):
            step = jax.jit(traceable.fn, in_shardings=traceable.in_shardings).lower(*traceable.args).compile()
        return mesh, traceable.in_shardings[0], step

    init = init_train_state(spec, optimizer, jax.random.key(0))
    out = {"mesh": {}, "hlo_permute": {}}
    losses, states = {}, {}
    for name, p in (("staged", staged), ("flat", flat)):
        mesh, shardings, step = runner(p)
        out["mesh"][name] = {k: int(v) for k, v in mesh.shape.items()}
        out["hlo_permute"][name] = "collective-permute" in step.as_text()
        state = jax.device_put(init, shardings)
        losses[name] = []
        for batch in batches:
            state, metrics = step(state, batch, schedule)
            losses[name].append(float(metrics["loss"]))
        states[name] = (state, shardings, step)
    # Each plan's final state, moved onto the other plan's mesh, takes one more step there.
    crossed = {}
    for source, target in (("staged", "flat"), ("flat", "staged")):
        state, _, _ = states[source]
        _, shardings, step = states[target]
        _, metrics = step(jax.device_put(state, shardings), batches[0], schedule)
        crossed[f"{source}->{target}"] = float(metrics["loss"])
    out["losses"] = losses
    out["crossed"] = crossed
    out["pipeline"] = staged.pipeline.model_dump()
    return out


# The dense model in the default suite (about 20 s of CPU); the MoE model with the slow tests.
@pytest.fixture(scope="module", params=["llama3-tiny", pytest.param("moe-tiny", marks=pytest.mark.slow)])
def trained(request) -> dict:
    return child_report(__file__, request.param, timeout=900,
                        XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


def test_plan_with_stages_trains_like_the_plan_without(trained):
    assert trained["mesh"]["staged"]["stage"] == 2 and trained["mesh"]["flat"]["stage"] == 1
    assert trained["pipeline"]["stages"] == 2 and trained["pipeline"]["microbatches"] == MICROBATCHES
    staged, flat = trained["losses"]["staged"], trained["losses"]["flat"]
    assert flat[0] > 1.0 and flat[-1] < flat[0]  # a real loss, falling
    assert staged == pytest.approx(flat, rel=2e-5)
    # The stage dimension is split over devices: activations cross between stages.
    assert trained["hlo_permute"]["staged"]


def test_train_state_moves_between_plans_with_and_without_stages(trained):
    crossed = trained["crossed"]
    assert crossed["staged->flat"] == pytest.approx(crossed["flat->staged"], rel=2e-5)


def test_plan_json_and_explain_show_the_pipeline():
    from mxc.compiler.plan.report import plan_text

    _, staged, flat = _plans("llama3-tiny", 2)
    data = staged.to_json()
    assert data["mesh"]["stage"] == 2 and data["rules"]["layers"] == ["stage"]
    assert data["pipeline"] == {"stages": 2, "microbatches": MICROBATCHES, "repeats": 1, "segment": 0,
                                "layers": 2, "bubble_fraction": pytest.approx(1 / 5)}
    assert data["time"]["bubble_fraction"] == pytest.approx(1 / 5)
    assert set(flat.to_json()) == set(data) - {"pipeline"}  # a plan without stages keeps its keys
    assert flat.to_json()["mesh"]["stage"] == 1 and flat.time.bubble_fraction == 0.0
    text = plan_text(staged)
    assert "pipeline bubble 20.0% of the step (2 stages)" in text
    assert "pipeline: 2 stages over segment 0 (2 layers)" in text
    # The bubble is charged: the same work without it is faster by the formula.
    assert staged.time.step_s > flat.time.step_s


def test_saved_plan_with_stages_round_trips(tmp_path):
    from mxc.compiler.plan import Plan

    _, staged, _ = _plans("llama3-tiny", 2)
    staged.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == staged
    broken = json.loads((tmp_path / "plan.json").read_text())
    broken["pipeline"] = None
    with pytest.raises(ValueError, match="mesh stage 2 needs a pipeline of 2 stages"):
        Plan.model_validate(broken)



def test_a_stage_pays_the_collectives_of_its_own_layers_only():
    """The formula charges every device the FSDP gathers and per-layer collectives of the whole
    model for every microbatch; with stages a device gathers its stage's layers per microbatch
    and the other weights (embedding, head) once a step, and runs 1/stages of the layers."""
    from mxc.compiler.plan import cost, stages
    from mxc.compiler.plan.choice import Choice
    from mxc.compiler.plan.layout import parameters
    from mxc.compiler.plan.plan import MESH_AXES
    from mxc.compiler.plan.rules import make_rules
    from mxc.compiler.topology import parse
    from mxc.spec.load import load_model

    spec = load_model("llama3.1-70b")
    params = parameters(spec)
    mesh = {axis: 1 for axis in MESH_AXES} | {"stage": 2, "fsdp": 16, "tensor": 2}
    rules = stages.with_stage_rules(make_rules(mesh, params.tensors)[0], mesh, params.tensors)
    assert rules["layers"] == ("stage",)
    microbatches = 4
    choice = Choice(spec, params, parse("v5p-64"), mesh, {}, rules, 4096, 64, microbatches, "full", "xla")
    plain = cost.step_time(choice)
    staged = stages.adjust_time(choice, plain)
    # Independently: the parameters of the 80 layers (one segment, all pipelined) and the rest.
    layers = sum(t.size for t in params.tensors if t.path.startswith("segments/"))
    rest = params.size - layers
    share = (microbatches * layers / 2 + rest) / (microbatches * params.size)
    assert 0.45 < share < 0.55
    for name in ("fsdp all-gather", "fsdp reduce-scatter"):
        assert staged.communication[name] == pytest.approx(plain.communication[name] * share, rel=1e-3)
    assert staged.communication["tensor all-reduce"] == pytest.approx(plain.communication["tensor all-reduce"] / 2,
                                                                     rel=1e-3)
    assert staged.communication["stage collective-permute"] > 0
    assert staged.bubble_fraction == pytest.approx(1 / 5)



def test_maxtext_pipeline_settings_become_a_plan_with_stages():
    from mxc.compiler.plan.maxtext import MaxTextError, parse_pairs, plan_setting
    from mxc.compiler.topology import parse
    from mxc.spec.load import load_model

    spec, topology = load_model("llama3.1-70b"), parse("v5p-64")
    base = ["per_device_batch_size=2", "max_target_length=4096", "remat_policy=full"]

    def planned(extra):
        return plan_setting(spec, topology, parse_pairs(base + extra), verify=False)

    plan = planned(["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=-1", "num_pipeline_microbatches=8",
                    "num_layers_per_pipeline_stage=20"])
    assert plan.mesh["stage"] == 4 and plan.mesh["fsdp"] == 8 and plan.microbatches == 8  # 32 chips
    assert plan.pipeline.model_dump() == {"stages": 4, "microbatches": 8, "repeats": 1, "segment": 0, "layers": 80,
                                          "bubble_fraction": pytest.approx(3 / 11)}
    assert plan.rules["layers"] == ["stage"]  # each stage holds its own 20 layers
    assert plan.time.bubble_fraction == pytest.approx(3 / 11)
    assert any("4 stages, 20 layers each" in r for r in plan.reasons)
    # MaxText's default num_pipeline_microbatches (-1) is one per stage.
    assert planned(["dcn_pipeline_parallelism=1", "ici_pipeline_parallelism=2",
                    "num_layers_per_pipeline_stage=40"]).microbatches == 2
    refused = {
        "repeats": (["ici_pipeline_parallelism=4"], "1 \\(MaxText's default\\) asks for 20 repeats"),
        "subset": (["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=20", "pipeline_parallel_layers=64"],
                   "pipelines the first 80 layers"),
        "accumulation": (["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=20",
                          "gradient_accumulation_steps=2"], "takes every microbatch"),
        "microbatches": (["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=20",
                          "num_pipeline_microbatches=5"], "does not divide the batch of 64"),
    }
    for name, (extra, message) in refused.items():
        with pytest.raises(MaxTextError, match=message):
            planned(extra)
    # Without stages the pipeline keys change nothing, and are listed as ignored.
    flat = planned(["num_pipeline_microbatches=8"])
    assert flat.mesh["stage"] == 1 and flat.microbatches == 1
    assert any("ignored" in r and "num_pipeline_microbatches" in r for r in flat.reasons)


if __name__ == "__main__":
    import sys

    print(json.dumps(_child(sys.argv[1])))
