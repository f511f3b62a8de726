"""Memory levers the planner can choose: MaxText's checkpoint names and remat policies (custom
per-name device/offload/remat included), each layer's input offloaded to host memory, and the
residual stream's sequence split over tensor (sequence parallelism). Each is checked for the
values and gradients it computes (equal to the plain program), for what it saves (jax's saved
residuals; XLA's memory analysis of a TPU program, slow) and for how the planner counts it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from artifact_builds import child_report
from mxc.compiler.lower import remat
from mxc.compiler.plan.search import evaluate
from mxc.compiler.topology import parse
from mxc.spec.load import load_model, load_text

OFFLOAD = "offload"
MAXTEXT_70B = remat.custom(decoder_layer_input=OFFLOAD, query_proj=OFFLOAD, key_proj=OFFLOAD, value_proj=OFFLOAD)
LAYER_INPUT_OFFLOADED = remat.custom(decoder_layer_input=OFFLOAD)


# ------------------------------------------------------------------ names and policies

def test_policies_are_maxtexts_names():
    # MaxText's remat_policy values (MaxText/layers/decoders.py), spelled as MaxText spells them.
    for name in ("full", "minimal", "minimal_with_context", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
                 "qkv_proj_offloaded", "minimal_offloaded", "save_dot_with_context_except_mlp", "save_out_proj",
                 "custom"):
        assert name in remat.POLICY_NAMES
    assert {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi",
            "mlpwo"} <= set(remat.CHECKPOINT_NAMES)
    assert remat.saved("minimal_with_context") == remat.Saved(device=("context",), dots="device")
    assert remat.saved("save_dot_except_mlpwi").device == ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo")
    assert remat.saved(MAXTEXT_70B) == remat.Saved(host=("decoder_layer_input", "query_proj", "key_proj", "value_proj"))
    assert remat.canonical("save_qkv_offloaded") == "qkv_proj_offloaded"  # a name earlier plans used


@pytest.mark.parametrize("name,message", [
    ("custom:decoder_input=offload", "unknown checkpoint name 'decoder_input'; the names are decoder_layer_input"),
    ("custom:query_proj=host", "query_proj must be one of device, offload, remat, not 'host'"),
    ("custom:query_proj=device,query_proj=offload", "query_proj is set twice"),
    ("custom", "custom needs settings"),
    ("save_dot_except_mlpwo", "choose one of none, full, minimal, "),
])
def test_bad_policies_are_one_clear_error(name, message):
    with pytest.raises(ValueError, match=message):
        remat.policy(name)


def test_plan_command_takes_a_custom_policy_and_refuses_a_bad_one(capsys):
    from mxc.compiler.cli import main

    args = ["plan", "llama3.1-8b", "--topology", "v6e-256", "--seq", "8192", "--batch", "256", "--no-verify",
            "--pin", "fsdp=256", "--json"]
    assert main([*args, "--remat", MAXTEXT_70B]) == 0
    assert MAXTEXT_70B in capsys.readouterr().out
    assert main([*args, "--remat", "custom:query_proj=host"]) != 0
    assert "custom:query_proj=host" in capsys.readouterr().err


def _tiny_layer():
    """llama3-tiny's first layer: (block, its parameters' shapes, a function of (x, parameters))."""
    from mxc.compiler.lower.block import block_layer
    from mxc.compiler.lower.params import init_params

    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    shapes = jax.eval_shape(lambda: jax.tree.map(lambda a: a[0], init_params(spec, jax.random.key(0))["segments"][0][0]))
    block = spec.blocks[spec.layers[0].period[0]]
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    return spec, shapes, lambda x, layer: block_layer(block, layer, x, positions)[0]


def test_offloaded_layer_input_leaves_device_memory(capsys):
    """jax.checkpoint saves a function's inputs, unless the input is named and the policy offloads
    the name: then the host copy is the residual and the device array is not."""
    spec, shapes, layer = _tiny_layer()
    x = jax.ShapeDtypeStruct((2, 16, spec.d_model), jnp.float32)
    for name in ("full", LAYER_INPUT_OFFLOADED):
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(lambda x, p: layer(x, p).sum(), policy=remat.policy(name)),
                                                x, shapes)
    full, offloaded = capsys.readouterr().out.split("f32[2,16,64] from the argument x")
    assert "<host>" not in full and "from the argument x" not in offloaded
    assert "f32<host>[2,16,64]" in offloaded


def _layer_values_and_gradients(name: str):
    spec, shapes, layer = _tiny_layer()
    keys = iter(jax.random.split(jax.random.key(2), 32))
    params = jax.tree.map(lambda s: 0.1 * jax.random.normal(next(keys), s.shape), shapes)
    x = jax.random.normal(next(keys), (2, 16, spec.d_model))
    fn = layer if name == "none" else jax.checkpoint(layer, policy=remat.policy(name))
    return jax.jit(jax.value_and_grad(lambda x, p: jnp.sum(jnp.sin(fn(x, p))), argnums=(0, 1)))(x, params)


def _assert_equal_values_and_gradients(name: str, plain_name: str = "none"):
    (value, grads), (plain, plain_grads) = _layer_values_and_gradients(name), _layer_values_and_gradients(plain_name)
    assert float(jnp.abs(value - plain)) <= 1e-6 * max(1.0, float(jnp.abs(plain)))
    leaves, plain_leaves = jax.tree.leaves(grads), jax.tree.leaves(plain_grads)
    assert len(leaves) == len(plain_leaves) > 5
    for a, b in zip(leaves, plain_leaves):
        assert float(jnp.abs(a - b).max()) <= 1e-6 * max(1.0, float(jnp.abs(b).max()))


def test_offloading_policy_gives_the_plain_layers_values_and_gradients():
    """MaxText's Llama 3.1 70B policy (layer input and q/k/v projections offloaded) on one layer,
    against no rematerialisation: the value and the gradient of the input and every parameter.
    The CPU backend has a pinned_host memory space, so the offloading program itself runs here
    (its host and device memory being the same RAM)."""
    assert remat.host_memory_available()
    _assert_equal_values_and_gradients(MAXTEXT_70B)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in remat.POLICY_NAMES if n not in ("none", "custom")]
                         + [remat.custom(decoder_layer_input=OFFLOAD, query_proj=OFFLOAD, key_proj=OFFLOAD,
                                         value_proj=OFFLOAD, out_proj=OFFLOAD)])
def test_every_policy_gives_the_plain_layers_values_and_gradients(name):
    _assert_equal_values_and_gradients(name)


# ------------------------------------------------------------------ sequence parallelism

@pytest.fixture(scope="module")
def sequence_parallel() -> dict:
    return child_report("sequence_parallel", timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                        JAX_PLATFORMS="cpu")


@pytest.mark.slow
def test_sequence_parallel_gives_the_same_loss_and_gradients(sequence_parallel):
    for layout in ("default", "sequence_parallel"):
        result = sequence_parallel[layout]
        assert result["loss_diff"] < 1e-5, layout
        assert result["grad_diff"] < 1e-5 * result["grad_scale"], layout


@pytest.mark.slow
def test_sequence_parallel_splits_the_residual_stream(sequence_parallel):
    default, split = sequence_parallel["default"], sequence_parallel["sequence_parallel"]
    # 8 rows over fsdp 4, 32 tokens over tensor 2 between layers
    assert default["hidden_shard"] == [2, 32, 64] and split["hidden_shard"] == [2, 16, 64]
    assert split["hidden_spec"][1] == "tensor"
    # the split stream is gathered back before the projections (the CPU backend all-reduces and
    # slices where a TPU reduce-scatters, so the reduce-scatters are not counted here)
    assert split["collectives"]["all-gather"] > default["collectives"]["all-gather"]


# ------------------------------------------------------------------ the planner's memory model

def test_the_planner_counts_offloaded_layer_inputs_in_host_memory():
    spec, topology = load_model("llama3.1-70b"), parse("v6e-256")
    setting = dict(seq=8192, batch=1280, mesh={"fsdp": 256})
    full = evaluate(spec, topology, remat="full", **setting)
    offloaded = evaluate(spec, topology, remat=LAYER_INPUT_OFFLOADED, **setting)
    layer_input = 5 * 8192 * spec.d_model * 2  # 5 sequences per device, bfloat16
    layers = len(spec.layer_kinds)
    assert full.predicted.activations == layers * layer_input and full.predicted.host == 0
    assert offloaded.predicted.activations == 0 and offloaded.predicted.host == layers * layer_input
    assert offloaded.predicted.total < full.predicted.total
    assert offloaded.time.communication["host offload"] > 0  # its traffic is charged


def test_the_planner_divides_the_residual_stream_by_tensor_under_sequence_parallelism():
    from mxc.compiler.plan.rules import sequence_parallel

    spec, topology = load_model("llama3.1-8b"), parse("v6e-256")
    setting = dict(seq=8192, batch=256, mesh={"fsdp": 64, "tensor": 4}, remat="full")
    plain = evaluate(spec, topology, **setting)
    split = evaluate(spec, topology, sequence_parallel=True, **setting)
    assert not sequence_parallel(plain.rules_tuples()) and sequence_parallel(split.rules_tuples())
    assert split.rules["residual_seq"] == ["context", "tensor"]
    # full remat keeps only each layer's input: the residual stream, now split four ways
    assert plain.predicted.activations == 4 * split.predicted.activations > 0


# XLA's totals (GiB of the 31.24 a v6e device has) for MaxText's one-microbatch offloading
# settings, compiled through --maxtext for the real topology (docs/plans.md, "Memory levers").
MAXTEXT_SETTINGS_XLA_GIB = {"Llama 3.1 70B, v6e-256": 29.97, "Llama 3.1 405B, 2 x v6e-256": 30.14,
                            "Mixtral 8x7B, v6e-256": 29.1}


def test_the_planner_predicts_maxtexts_offloading_settings_within_15_percent_of_xla():
    from mxc.compiler.plan.calibration import published_rows
    from mxc.compiler.plan.maxtext import plan_setting

    rows = {row["name"]: row for row in published_rows()}
    for name, xla_gib in MAXTEXT_SETTINGS_XLA_GIB.items():
        row = rows[name]
        setting = plan_setting(load_model(row["model"]), parse(row["topology"], row["slices"]), row["tuning_params"],
                               verify=False)
        assert setting.microbatches == 1 and setting.predicted.host > 40 * 2**30
        assert abs(setting.predicted.total / 2**30 / xla_gib - 1) < 0.15, name
        assert setting.fits


def test_xla_squeezes_temporaries_only_where_their_irreducible_part_fits():
    from mxc.compiler.plan.memory import SQUEEZED_SHARE, squeezed

    hbm, beside = 100.0, 10.0
    assert squeezed(80, 50, hbm, beside) == 80  # fits as asked
    assert squeezed(120, 50, hbm, beside) == SQUEEZED_SHARE * hbm - beside  # squeezed near the limit
    assert squeezed(120, 85, hbm, beside) == 85  # squeezed to its irreducible part
    assert squeezed(120, 95, hbm, beside) == 120  # refused: XLA reports the whole need


def test_the_search_considers_the_levers():
    from mxc.compiler.plan.candidates import choices
    from mxc.compiler.plan.layout import parameters
    from mxc.compiler.plan.rules import sequence_parallel

    spec, topology = load_model("llama3.1-8b"), parse("v6e-8")
    found = list(choices(spec, parameters(spec), topology, 8192, 8, {"tensor": 4, "fsdp": 2}, microbatches=1))
    assert any(remat.saved(c.remat).host == ("decoder_layer_input",) for c in found)
    assert {sequence_parallel(c.rules) for c in found} == {True, False}
    cpu = list(choices(spec, parameters(spec), parse("cpu-8"), 8192, 8, {"tensor": 4, "fsdp": 2}, microbatches=1))
    assert not any(remat.needs_host_memory(c.remat) for c in cpu)  # no host offload off TPU


# ------------------------------------------------------------------ XLA's memory analysis (TPU)

SMALL_LLAMA = """
model llama-levers {
  vocab = 32000
  d_model = 2048
  max_seq = 8192
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  block x 8 {
    attention = gqa(heads = 16, kv_heads = 8, head_dim = 128, rope = rope(theta = 10000))
    mlp = glu(hidden = 5632, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
"""


def _compiled_memory(remat_name: str, sequence_parallel: bool = False):
    from mxc.compiler.plan.verify import verify

    spec = load_text(SMALL_LLAMA, "levers.mspec")["llama-levers"]
    topology = parse("v5e-8")
    mesh = {"fsdp": 2, "tensor": 4} if sequence_parallel is not None else {"fsdp": 8}
    draft = evaluate(spec, topology, seq=4096, batch=16, mesh=mesh, remat=remat_name,
                     sequence_parallel=bool(sequence_parallel))
    verdict = verify(spec, draft, topology)
    assert verdict.memory is not None, verdict.reason
    return draft, verdict.memory


@pytest.mark.slow
def test_xla_shows_the_offloaded_layer_inputs_leave_hbm():
    """An 8-layer Llama on v5e-8 (fsdp 8), compiled for TPU from libtpu's topology description:
    offloading each layer's input moves the scanned stack of layer inputs to host memory."""
    plain_plan, plain = _compiled_memory("full", sequence_parallel=None)
    offload_plan, offloaded = _compiled_memory(LAYER_INPUT_OFFLOADED, sequence_parallel=None)
    stack = offload_plan.predicted.host  # 8 layers x 2 sequences x 4096 x 2048 x bfloat16 = 256 MiB
    assert stack == 8 * 2 * 4096 * 2048 * 2
    assert offloaded.host_temporaries >= stack
    # XLA's peak counts the host buffers too; on device it drops by more than the stack (measured:
    # 2825 MiB to 2456 MiB for a 256 MiB stack)
    assert plain.peak - (offloaded.peak - offloaded.host_temporaries) > stack
    # Without the collective-matmul loops (xla_options) XLA's totals are 2566 and 2294 MiB, both
    # peaking at the loss (float32 logits 1000 MiB, the head's float32 gradient 250 MiB); predicted
    # 2726 (1.062) and 2547 (1.111: the offloading plan is counted holding the logits through the
    # layers' backward, memory.UNTIED_HEAD_LOGITS, which XLA frees at the loss here). The rule for
    # programs with the loops (1.5 logits and two gathered layers at the loss) predicted 1.132, 1.155.
    for plan, xla in ((plain_plan, plain), (offload_plan, offloaded)):
        assert abs(plan.predicted.total / xla.total - 1) < 0.15


@pytest.mark.slow
def test_xla_shows_sequence_parallelism_splits_the_saved_residual_stream():
    plain_plan, plain = _compiled_memory("full", sequence_parallel=False)
    split_plan, split = _compiled_memory("full", sequence_parallel=True)
    saved = plain_plan.predicted.activations - split_plan.predicted.activations  # 3/4 of the stack
    assert saved > 0
    # XLA saves less than the planner credits (measured: 203 MiB of 768 MiB; docs/plans.md)
    assert plain.total - split.total > 0.2 * saved
    for plan, xla in ((plain_plan, plain), (split_plan, split)):
        assert abs(plan.predicted.total / xla.total - 1) < 0.15
