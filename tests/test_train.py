"""Loss, optimizer and train step: checked against numpy references and against each other."""

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mxc.compiler.lower.loss import cross_entropy_loss, loss_sums
from mxc.compiler.lower.optimizer import (OptimizerConfig, learning_rate_schedule, make_optimizer,
                                          weight_decay_mask)
from mxc.compiler.lower.train import (TrainState, batch_from_sequences, init_train_state, make_eval_step,
                                      make_gradient_step, make_train_step, split_microbatches)
from mxc.spec.load import load_model


# ------------------------------------------------------------------ loss

def _numpy_loss(logits, targets, mask, z_loss_weight):
    logits = np.asarray(logits, np.float64)
    peak = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
    target_logit = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    tokens = mask.sum()
    cross_entropy = ((log_z - target_logit) * mask).sum() / tokens
    z_loss = z_loss_weight * (log_z ** 2 * mask).sum() / tokens
    accuracy = ((logits.argmax(-1) == targets) * mask).sum() / tokens
    return cross_entropy, z_loss, accuracy, tokens


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_loss_matches_numpy_reference(z_loss_weight):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7, 13)).astype(np.float32) * 3
    targets = rng.integers(0, 13, size=(3, 7))
    mask = (rng.random((3, 7)) < 0.6).astype(np.float32)
    loss, metrics = cross_entropy_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask),
                                       z_loss_weight=z_loss_weight)
    cross_entropy, z_loss, accuracy, tokens = _numpy_loss(logits, targets, mask, z_loss_weight)
    np.testing.assert_allclose(float(metrics["cross_entropy"]), cross_entropy, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["z_loss"]), z_loss, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(float(loss), cross_entropy + z_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), accuracy, rtol=1e-6)
    assert float(metrics["tokens"]) == tokens


def test_accuracy_counts_a_target_with_the_largest_logit():
    logits = jnp.asarray([[[1.0, 5.0, 5.0, 0.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 4.0, 4.0]]])
    # target 2 ties the maximum (counts), 1 is below it, 3 ties it (counts)
    _, metrics = cross_entropy_loss(logits, jnp.asarray([[2, 1, 3]]))
    assert float(metrics["accuracy"]) == pytest.approx(2 / 3)


def test_masked_positions_do_not_count():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 6, 9)).astype(np.float32)
    targets = rng.integers(0, 9, size=(2, 6))
    mask = np.ones((2, 6), np.float32)
    mask[0, 4:] = 0
    mask[1, 0] = 0
    scrambled = logits.copy()
    scrambled[mask == 0] = rng.normal(size=scrambled[mask == 0].shape) * 50
    first, _ = cross_entropy_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    second, _ = cross_entropy_loss(jnp.asarray(scrambled), jnp.asarray(targets), jnp.asarray(mask))
    assert float(first) == pytest.approx(float(second), rel=1e-6)


def test_bfloat16_logits_are_reduced_in_float32():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 4, 50000)) * 4, jnp.bfloat16)
    targets = rng.integers(0, 50000, size=(2, 4))
    loss, _ = cross_entropy_loss(logits, jnp.asarray(targets))
    assert loss.dtype == jnp.float32
    reference, *_ = _numpy_loss(np.asarray(logits.astype(jnp.float32)), targets, np.ones((2, 4)), 0.0)
    np.testing.assert_allclose(float(loss), reference, rtol=1e-5)


def test_batch_from_sequences_shifts_by_one():
    sequences = jnp.arange(12).reshape(2, 6)
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    batch = batch_from_sequences(sequences, mask)
    np.testing.assert_array_equal(batch["inputs"], [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]])
    np.testing.assert_array_equal(batch["targets"], [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(batch["mask"], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


def test_microbatch_split_interleaves_rows():
    batch = {"inputs": jnp.arange(8)[:, None] * jnp.ones((1, 3), jnp.int32)}
    split = split_microbatches(batch, 4)["inputs"]
    assert split.shape == (4, 2, 3)
    np.testing.assert_array_equal(split[:, :, 0], [[0, 4], [1, 5], [2, 6], [3, 7]])


# ------------------------------------------------------------------ optimizer

def test_schedule_is_linear_warmup_then_cosine():
    config = OptimizerConfig(learning_rate=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    schedule = learning_rate_schedule(config)

    def reference(step):
        if step < 10:
            return 1e-3 * step / 10
        progress = min((step - 10) / 100, 1.0)
        return 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))

    for step in (0, 1, 5, 10, 11, 35, 60, 100, 110, 500):
        assert float(schedule(step)) == pytest.approx(reference(step), rel=1e-5, abs=1e-10), step


def test_default_warmup_is_a_tenth_and_must_fit():
    assert OptimizerConfig(total_steps=500).resolved_warmup_steps == 50
    with pytest.raises(ValueError, match="exceeds total_steps"):
        OptimizerConfig(total_steps=10, warmup_steps=20)


def test_decay_mask_on_llama_parameters_excludes_norms_and_biases():
    from mxc.compiler.lower.params import param_axes, param_shapes

    spec = load_model("llama3-tiny")
    mask = weight_decay_mask(param_shapes(spec), param_axes(spec))
    block = mask["segments"][0][0]
    assert mask["embed"]["embedding"] and mask["head"]["kernel"]
    assert all(block["attention"][name]["kernel"] for name in "qkvo")
    assert all(block["mlp"][name]["kernel"] for name in ("gate", "up", "down"))
    # Stacked over layers these are 2-D arrays; their logical axes say they are vectors.
    assert not block["attention_norm"]["scale"] and not block["mlp_norm"]["scale"]
    assert not mask["final_norm"]["scale"]


def test_decay_mask_without_axes_uses_rank_and_names():
    params = {"dense": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros((4,))},
              "layer_norm": {"scale": jnp.zeros((2, 4))}, "vector": jnp.zeros((5,))}
    mask = weight_decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False}, "layer_norm": {"scale": False},
                    "vector": False}


def test_weight_decay_applies_only_where_masked():
    # With zero gradients Adam's step is zero, so all that moves a parameter is decoupled decay.
    config = OptimizerConfig(learning_rate=0.1, warmup_steps=0, total_steps=10, weight_decay=0.5)
    params = {"kernel": jnp.full((2, 2), 2.0), "norm": {"scale": jnp.full((2,), 2.0)}}
    optimizer = make_optimizer(config)
    updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["kernel"], 2.0 * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_allclose(new["norm"]["scale"], 2.0)


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_first_update_matches_numpy_adamw_with_clipping(clip_norm):
    # eps = 1 makes the first Adam step depend on the gradient's size, so clipping shows.
    config = OptimizerConfig(learning_rate=0.01, warmup_steps=0, total_steps=10, eps=1.0,
                             weight_decay=0.1, clip_norm=clip_norm)
    rng = np.random.default_rng(3)
    params = {"kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
    grads = {"kernel": jnp.asarray(rng.normal(size=(3, 4)) * 2, jnp.float32)}
    optimizer = make_optimizer(config)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    g = np.asarray(grads["kernel"], np.float64)
    if clip_norm is not None:
        g = g * min(1.0, clip_norm / np.linalg.norm(g))
    # First step, bias-corrected: m̂ = g, v̂ = g².
    expected = -0.01 * (g / (np.abs(g) + 1.0) + 0.1 * np.asarray(params["kernel"]))
    np.testing.assert_allclose(updates["kernel"], expected, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ train step on a stand-in model

def _stand_in_sums(params, batch):
    hidden = jnp.tanh(params["embed"][batch["inputs"]])
    return loss_sums(hidden @ params["head"], batch["targets"], batch["mask"], z_loss_weight=1e-3)


def _stand_in_state(config, vocab=17, width=8):
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"embed": jax.random.normal(keys[0], (vocab, width)),
              "head": jax.random.normal(keys[1], (width, vocab)) * 0.3}
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(config).init(params))


def _ragged_batch(rows=8, seq=6, vocab=17, seed=0):
    rng = np.random.default_rng(seed)
    sequences = rng.integers(0, vocab, size=(rows, seq + 1))
    # Padding falls unevenly across microbatches: a per-microbatch mean would weight tokens wrongly.
    lengths = rng.integers(1, seq + 2, size=rows)
    mask = np.arange(seq + 1)[None, :] < lengths[:, None]
    return batch_from_sequences(jnp.asarray(sequences), jnp.asarray(mask))


def test_microbatches_equal_one_batch_on_a_stand_in():
    config = OptimizerConfig(learning_rate=0.05, warmup_steps=0, total_steps=10, eps=1e-3)
    schedule = learning_rate_schedule(config)
    batch = _ragged_batch()
    results = {}
    for microbatches in (1, 2, 4):
        step = jax.jit(make_gradient_step(_stand_in_sums, make_optimizer(config), schedule,
                                          microbatches=microbatches))
        results[microbatches] = step(_stand_in_state(config), batch)
    (state_1, metrics_1) = results[1]
    for microbatches in (2, 4):
        state, metrics = results[microbatches]
        for name in ("loss", "tokens", "accuracy", "grad_norm", "learning_rate"):
            np.testing.assert_allclose(metrics[name], metrics_1[name], rtol=1e-5, err_msg=name)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     state.params, state_1.params)
        assert int(state.step) == 1


def test_grad_norm_metric_is_the_unclipped_norm():
    config = OptimizerConfig(learning_rate=0.05, warmup_steps=0, total_steps=10, clip_norm=1e-3)
    batch = _ragged_batch(seed=4)
    state = _stand_in_state(config)
    step = make_gradient_step(_stand_in_sums, make_optimizer(config), learning_rate_schedule(config))
    _, metrics = step(state, batch)

    def mean_loss(params):
        sums = _stand_in_sums(params, batch)
        return sums.total() / sums.tokens

    reference = optax.tree.norm(jax.grad(mean_loss)(state.params))
    np.testing.assert_allclose(metrics["grad_norm"], reference, rtol=1e-5)
    assert float(metrics["grad_norm"]) > 1e-3  # so clipping really was active


# ------------------------------------------------------------------ remat policies

def test_remat_names_are_the_layer_codes_names():
    from mxc.compiler.lower import remat
    from mxc.compiler.lower.model import CHECKPOINT_NAMES

    assert set(remat.CHECKPOINT_NAMES) == set(CHECKPOINT_NAMES)


@pytest.mark.parametrize("name,kept,offloaded", [
    ("full", set(), 0),
    ("save_qkv_proj", {"query_proj", "key_proj", "value_proj"}, 0),
    ("save_out_proj", {"out_proj"}, 0),
    ("save_dot_with_context_except_mlp", {"query_proj", "key_proj", "value_proj", "context", "out_proj"}, 0),
    ("save_dot_except_mlpwi", {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"}, 0),
    ("save_dot_except_mlp", {"query_proj", "key_proj", "value_proj", "out_proj"}, 0),
    ("qkv_proj_offloaded", set(), 3),
    ("save_qkv", {"query_proj", "key_proj", "value_proj"}, 0),  # an earlier plan's name
    ("custom:decoder_layer_input=offload,query_proj=device,out_proj=remat", {"query_proj"}, 1),
])
def test_policies_keep_what_their_names_say(name, kept, offloaded, capsys):
    from jax.ad_checkpoint import checkpoint_name

    from mxc.compiler.lower import remat

    def layer(x):
        # One nonlinear use per tagged value, so each would be a residual if nothing were recomputed.
        tagged = [checkpoint_name(jnp.sin(x * (i + 1)), tag) for i, tag in enumerate(remat.CHECKPOINT_NAMES)]
        return sum(jnp.sin(t) for t in tagged).sum()

    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=remat.policy(name)), jnp.ones(3))
    lines = capsys.readouterr().out.splitlines()
    assert {tag for tag in remat.CHECKPOINT_NAMES if any(f"named '{tag}'" in line for line in lines)} == kept
    assert sum("<host>" in line for line in lines) == offloaded


def test_unknown_policy_lists_the_known_ones():
    from mxc.compiler.lower import remat

    with pytest.raises(ValueError, match="choose one of none, full, minimal, "):
        remat.policy("everything")
    assert remat.policy("none") is None


# ------------------------------------------------------------------ the real model (llama3-tiny)

def _tiny_float32():
    # float32 compute, so comparisons between equal computations are tight.
    return load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})


def _counting_batch(rng, rows=16, seq=32, period=64, offset=100):
    """Each row counts upward from a random start, modulo `period`: the next token is a function
    of the current one, which a 2-layer model learns in a few dozen steps."""
    start = rng.integers(0, period, size=(rows, 1))
    return batch_from_sequences(jnp.asarray((start + np.arange(seq + 1)[None]) % period + offset))


def test_accumulated_gradients_equal_one_batch_on_llama():
    from mxc.compiler.lower.params import init_params
    from mxc.compiler.lower.train import model_loss_sums

    spec = _tiny_float32()
    params = init_params(spec, jax.random.key(0))
    batch = _ragged_batch(rows=8, seq=16, vocab=spec.vocab, seed=5)
    sgd = optax.sgd(1.0)  # the parameter change is then exactly minus the accumulated gradient
    deltas = {}
    for microbatches, remat in ((1, "none"), (4, "full")):
        step = jax.jit(make_gradient_step(model_loss_sums(spec, remat=remat), sgd,
                                          optax.constant_schedule(1.0), microbatches=microbatches))
        state, _ = step(TrainState(jnp.zeros((), jnp.int32), params, sgd.init(params)), batch)
        deltas[microbatches] = jax.tree.map(jnp.subtract, state.params, params)
    scale = max(float(jnp.abs(d).max()) for d in jax.tree.leaves(deltas[1]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
                 deltas[4], deltas[1])


def test_tiny_llama_learns_a_pattern_with_and_without_accumulation():
    spec = load_model("llama3-tiny")  # bfloat16 compute, as it would train
    config = OptimizerConfig(learning_rate=1e-2, warmup_steps=5, total_steps=30)
    curves = {}
    for microbatches in (1, 4):
        state = init_train_state(spec, config, jax.random.key(0))
        step = jax.jit(make_train_step(spec, config, microbatches=microbatches, remat="none"))
        rng = np.random.default_rng(0)
        curves[microbatches] = []
        for _ in range(config.total_steps):
            previous, batch = state, _counting_batch(rng)
            state, metrics = step(state, batch)
            curves[microbatches].append(float(metrics["loss"]))
    for curve in curves.values():
        assert curve[0] == pytest.approx(math.log(spec.vocab), abs=0.1)  # starts at chance
        assert curve[-1] < 0.5, curve  # well below log(512) = 6.24
    np.testing.assert_allclose(curves[4], curves[1], rtol=0.05, atol=0.02)

    # The eval step sees what the train step saw: the same loss for the same params and batch.
    eval_metrics = jax.jit(make_eval_step(spec))(previous.params, batch)
    for name in ("loss", "cross_entropy", "accuracy", "tokens"):
        np.testing.assert_allclose(eval_metrics[name], metrics[name], rtol=1e-5, err_msg=name)
    assert float(metrics["learning_rate"]) == pytest.approx(float(learning_rate_schedule(config)(29)))
