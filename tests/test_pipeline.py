"""The circular pipeline (compiler/lower/pipeline.py) on 8 virtual CPU devices (a stage × fsdp
mesh) computes the same loss, the same gradient for every parameter and the same MoE statistics
as the plain scanned segment, for 2 and 4 stages, with and without repeats, and with layers left
over after the pipelined ones.

XLA fixes the number of host devices when jax starts, so the runs happen in a child process
started with XLA_FLAGS; this file is also that child's script. The reference runs each
microbatch through model.run_segment on its own (the train step's gradient accumulation), so the
MoE load-balancing loss is compared under the same per-microbatch convention.
"""

import json

import pytest

from artifact_builds import child_report

BATCH, SEQ, LAYERS, MICROBATCHES = 16, 8, 9, 4
# (model, stages, repeats): each model with 2 and 4 stages, with and without repeats between them.
# Nine layers leave one layer after the pipelined eight in every case; all cases split the batch
# into the same microbatches, so each model's reference is compiled once.
CASES = [
    ("llama3-tiny", 2, 1),
    ("llama3-tiny", 4, 2),
    ("moe-tiny", 2, 2),
    ("moe-tiny", 4, 1),
]
# The child compiles at XLA's lowest CPU optimisation level: the numerics are the same, the
# compiles about a third shorter.
CHILD_XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                   "--xla_llvm_disable_expensive_passes=true")


def _case_name(case) -> str:
    return "{}-{}stages-{}repeats".format(*case)


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from mxc.compiler.lower.model import embed, logits_from_hidden, run_segment
    from mxc.compiler.lower.moe import mean_aux_loss
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.pipeline import PipelineLayout, pipelined_segment
    from mxc.compiler.lower.sharding import use_rules
    from mxc.spec.ir import Segment
    from mxc.spec.load import load_model

    assert jax.device_count() == 8, jax.devices()
    tokens_all = {}
    references = {}
    report = {}
    for case in CASES:
        model, stages, repeats = case
        spec = load_model(model)
        spec = spec.model_copy(update={"compute_dtype": "float32",
                                       "layers": (Segment(period=spec.layers[0].period, repeat=LAYERS),)})
        segment = spec.layers[0]
        params = init_params(spec, jax.random.key(0))
        tokens = tokens_all.setdefault(model, jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, spec.vocab))
        positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, SEQ))
        layout = PipelineLayout(stages=stages, microbatches=MICROBATCHES, repeats=repeats)

        def cross_entropy(params, x, targets):
            logits = logits_from_hidden(spec, params, x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

        def pipelined(params, tokens):
            x = embed(spec, params, tokens[:, :-1], jnp.float32)
            x, stats = pipelined_segment(spec, segment, params["segments"][0], x, positions, layout=layout)
            return cross_entropy(params, x, tokens[:, 1:]) + 0.01 * mean_aux_loss([stats]), stats

        def reference(params, tokens):
            # Microbatch m is rows m, m + microbatches, ...; each runs through the plain scan alone
            # (the train step's gradient accumulation).
            def one(rows_and_positions):
                rows, pos = rows_and_positions
                x = embed(spec, params, rows[:, :-1], jnp.float32)
                x, _, stats = run_segment(spec, segment, params["segments"][0], x, pos)
                return cross_entropy(params, x, rows[:, 1:]) + 0.01 * mean_aux_loss([stats]), stats

            split = lambda a: a.reshape(a.shape[0] // MICROBATCHES, MICROBATCHES, *a.shape[1:]).swapaxes(0, 1)
            losses, stats = jax.lax.map(one, (split(tokens), split(positions)))
            loads = [None if s is None else jnp.sum(s.expert_load, axis=0) for s in stats]
            aux = [None if s is None else jnp.mean(s.aux_loss, axis=0) for s in stats]
            return jnp.mean(losses), (loads, aux)

        mesh = Mesh(np.array(jax.devices()).reshape(stages, 8 // stages), ("stage", "fsdp"))
        # MoE layers keep the batch whole (their batch-split shard_map is checked elsewhere).
        rules = {"batch": ("fsdp",)} if model == "llama3-tiny" else {}
        with use_rules(mesh, rules):
            step = jax.jit(jax.value_and_grad(pipelined, has_aux=True)).lower(params, tokens).compile()
        (loss, stats), grads = step(params, tokens)
        hlo = step.as_text()
        if model not in references:
            references[model] = jax.jit(jax.value_and_grad(reference, has_aux=True))(params, tokens)
        (ref_loss, (ref_loads, ref_aux)), ref_grads = references[model]
        grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
        grad_scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(ref_grads))
        moe_stats = [s for s in stats if s is not None]
        report[_case_name(case)] = {
            "loss": [float(loss), float(ref_loss)],
            "grad_max_abs_diff": grad_diff,
            "grad_max_abs": grad_scale,
            "gradient_leaves": len(jax.tree.leaves(grads)),
            "collective_permute": "collective-permute" in hlo,
            "moe_blocks": len(moe_stats),
            "load_max_abs_diff": max([float(jnp.max(jnp.abs(s.expert_load - r)))
                                      for s, r in zip(stats, ref_loads) if s is not None], default=0.0),
            "load_total": sum(float(jnp.sum(s.expert_load)) for s in moe_stats),
            "aux_max_abs_diff": max([float(jnp.max(jnp.abs(s.aux_loss - r)))
                                     for s, r in zip(stats, ref_aux) if s is not None], default=0.0),
            "stat_layers": [int(s.aux_loss.shape[0]) for s in moe_stats],
        }
    return report


@pytest.fixture(scope="module")
def reports() -> dict:
    """Every case's measurements, from one child process."""
    return child_report(__file__, timeout=900, XLA_FLAGS=CHILD_XLA_FLAGS, JAX_PLATFORMS="cpu")


@pytest.mark.parametrize("case", CASES, ids=_case_name)
def test_pipeline_loss_and_gradients_equal_the_plain_scan(reports, case):
    run = reports[_case_name(case)]
    pipelined, plain = run["loss"]
    assert plain > 1.0  # a real cross entropy over 512 tokens, not zeros
    assert pipelined == pytest.approx(plain, rel=1e-5)
    assert run["grad_max_abs"] > 1e-4
    assert run["grad_max_abs_diff"] <= 1e-4 * run["grad_max_abs"]
    # The stage dimension is really split: activations move between stage devices by collective-permute.
    assert run["collective_permute"]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "moe-tiny"], ids=_case_name)
def test_pipeline_moe_statistics_equal_the_plain_scan(reports, case):
    run = reports[_case_name(case)]
    assert run["moe_blocks"] == 1 and run["stat_layers"] == [LAYERS]  # one row per layer, in flat order
    assert run["load_total"] > 0
    assert run["load_max_abs_diff"] == 0.0  # whole assignment counts
    assert run["aux_max_abs_diff"] < 1e-5


def test_layout_refuses_what_it_cannot_schedule():
    from mxc.compiler.lower.pipeline import PipelineLayout

    with pytest.raises(ValueError, match="at least as many microbatches"):
        PipelineLayout(stages=4, microbatches=2, repeats=2).check(8, 16)
    with pytest.raises(ValueError, match="3 layers do not fill 2 stages x 2 repeats"):
        PipelineLayout(stages=2, microbatches=2, repeats=2).check(3, 16)
    with pytest.raises(ValueError, match="batch of 6 rows does not split into 4"):
        PipelineLayout(stages=2, microbatches=4).check(4, 6)
    layout = PipelineLayout(stages=4, microbatches=8, repeats=2)
    assert (layout.iterations, layout.pipelined(9)) == (19, 8)
    assert layout.bubble_fraction == pytest.approx(3 / 19)


if __name__ == "__main__":
    print(json.dumps(_child()))
