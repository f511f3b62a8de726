"""Mixture-of-experts lowering: routers against transformers' own router modules, the three expert
paths against each other (and sharded over an `expert` mesh axis on 8 virtual CPU devices), the
capacity path's dropping contract, parameter counts against the analysis, the load-balancing
loss and DeepSeek's bias update in training."""

from __future__ import annotations

import math
import os
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower import moe as moe_lib
from mxc.compiler.lower.moe import MoEConfig, Routing, capacity, moe_layer, route
from mxc.compiler.lower.params import ParamDef, moe_defs
from mxc.spec.ir import GLU, ClampedSwiGLU, MoE, Router
from runtime_support import child, cpu_env

D_MODEL = 32


def _init(defs, key, std=0.3):
    """Random values for a ParamDef tree: biases and norms too, so that a mix-up shows."""
    leaves, tree = jax.tree.flatten(defs, is_leaf=lambda d: isinstance(d, ParamDef))
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [std * jax.random.normal(k, d.shape, jnp.float32) for d, k in zip(leaves, keys)])


MOES = {
    "mixtral": MoE(experts=8, top_k=2, expert=GLU(hidden=24, act="silu"),
                   router=Router(score="softmax", normalize=True)),
    "gpt_oss": MoE(experts=8, top_k=3, expert=ClampedSwiGLU(hidden=24, alpha=1.702, limit=0.6),
                   router=Router(score="softmax", normalize=True, bias=True)),
    "llama4": MoE(experts=8, top_k=1, expert=GLU(hidden=24, act="silu"), shared_experts=1,
                  router=Router(score="sigmoid", normalize=False, weight_on="input")),
    "deepseek3": MoE(experts=16, top_k=4, expert=GLU(hidden=16, act="silu"), shared_experts=2,
                     router=Router(score="sigmoid", normalize=True, groups=4, top_groups=2, correction_bias=True,
                                   routed_scale=2.5)),
    "deepseek2": MoE(experts=16, top_k=3, expert=GLU(hidden=16, act="silu"), shared_experts=1,
                     router=Router(score="softmax", normalize=False, groups=4, top_groups=2, routed_scale=16.0)),
}


def _layer(name, seed=0):
    moe = MOES[name]
    params = _init(moe_defs(moe, D_MODEL), jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (3, 10, D_MODEL), jnp.float32)
    return moe, params, x


# ---------------------------------------------------------------- routers against transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_router(name, moe, params):
    """transformers' router module for `name`, holding `params` (weight [experts, embed])."""
    common = dict(hidden_size=D_MODEL, num_experts_per_tok=moe.top_k)
    weight = torch.tensor(np.asarray(params["router"]["kernel"]).T.copy())
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as cls
        router = cls(transformers.MixtralConfig(num_local_experts=moe.experts, **common))
    elif name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter as cls
        router = cls(transformers.GptOssConfig(num_local_experts=moe.experts, **common))
        router.bias.data = torch.tensor(np.asarray(params["router"]["bias"]))
    elif name == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4Router as cls
        router = cls(transformers.Llama4TextConfig(num_local_experts=moe.experts, **common))
    elif name == "deepseek3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as cls
        router = cls(transformers.DeepseekV3Config(n_routed_experts=moe.experts, n_group=4, topk_group=2,
                                                   routed_scaling_factor=2.5, norm_topk_prob=True, **common))
        router.e_score_correction_bias.data = torch.tensor(np.asarray(params["router"]["correction_bias"]))
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as cls
        router = cls(transformers.DeepseekV2Config(n_routed_experts=moe.experts, n_group=4, topk_group=2,
                                                   routed_scaling_factor=16.0, topk_method="group_limited_greedy",
                                                   **common))
    router.weight.data = weight
    return router


@pytest.mark.parametrize("name", list(MOES))
def test_router_matches_transformers(name):
    moe, params, x = _layer(name)
    tokens = x.reshape(-1, D_MODEL)
    mine = route(moe, params["router"], tokens)
    with torch.no_grad():
        out = _hf_router(name, moe, params)(torch.tensor(np.asarray(tokens)))
    if name == "llama4":  # (dense scores [tokens, experts], logits)
        scores = out[0].numpy()
        indices = np.argsort(-scores, axis=-1)[:, :moe.top_k]
        weights = np.take_along_axis(scores, indices, axis=-1)
    else:  # (logits, top-k weights, top-k indices)
        weights, indices = out[1].numpy(), out[2].numpy()
    reference = [dict(zip(i, w)) for i, w in zip(indices.tolist(), weights.tolist())]
    got = [dict(zip(i, w)) for i, w in zip(np.asarray(mine.experts).tolist(), np.asarray(mine.weights).tolist())]
    assert [sorted(r) for r in reference] == [sorted(g) for g in got]
    for r, g in zip(reference, got):
        np.testing.assert_allclose([g[e] for e in sorted(r)], [r[e] for e in sorted(r)], rtol=1e-5, atol=1e-6)
    # The grouped routers must really be confined to groups (else the test above proves little).
    if moe.router.groups > 1:
        groups = np.asarray(mine.experts) // (moe.experts // moe.router.groups)
        assert max(len(set(g)) for g in groups.tolist()) <= moe.router.top_groups
        ungrouped = route(moe.model_copy(update={"router": moe.router.model_copy(update={"groups": 1})}),
                          params["router"], tokens)
        assert not np.array_equal(np.sort(ungrouped.experts, -1), np.sort(mine.experts, -1))


def test_correction_bias_steers_selection_but_not_weights():
    moe, params, x = _layer("deepseek3")
    tokens = x.reshape(-1, D_MODEL)
    plain = route(moe, {**params["router"], "correction_bias": jnp.zeros(moe.experts)}, tokens)
    favoured = {**params["router"], "correction_bias": jnp.zeros(moe.experts).at[5].set(10.0)}
    steered = route(moe, favoured, tokens)
    assert (np.asarray(steered.experts) == 5).any(axis=-1).all()
    assert not (np.asarray(plain.experts) == 5).any(axis=-1).all()
    # Weights come from the unbiased scores: the bias of 10 does not show up in them.
    assert float(jnp.max(steered.weights)) < moe.router.routed_scale + 1e-6


# ---------------------------------------------------------------- expert paths

@pytest.mark.parametrize("name", list(MOES))
@pytest.mark.parametrize("path", ["dropless", "capacity"])
def test_paths_match_the_dense_reference(name, path):
    """With room for every assignment, the dropless and capacity paths compute the dense path's
    function, gradients included."""
    moe, params, x = _layer(name)
    config = MoEConfig(path=path, capacity_factor=float(moe.experts))

    def run(p, cfg):
        y, stats = moe_layer(moe, p, x, cfg)
        return jnp.sum(jnp.sin(y)), (y, stats)

    run = jax.jit(jax.value_and_grad(run, has_aux=True), static_argnums=1)
    (_, (y_ref, stats_ref)), grads_ref = run(params, MoEConfig(path="dense"))
    (_, (y, stats)), grads = run(params, config)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert float(stats.dropped) == 0.0
    np.testing.assert_array_equal(stats.expert_load, stats_ref.expert_load)
    assert float(jnp.sum(stats.expert_load)) == x.shape[0] * x.shape[1] * moe.top_k
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("tiles", [None, ((128, 128, 384), (128, 384, 128), (128, 128, 128)),
                                   ((256, 384, 128), (256, 128, 384), (256, 384, 384))])
def test_megablox_grouped_matmul_matches_ragged_dot(tiles, monkeypatch):
    """megablox's kernel (Pallas' interpreter off TPU), the dispatch's grouped matmul on TPU, gives
    ragged_dot's values and gradients, empty groups and rows past the groups included; also with
    unequal k and n tiles and other tiles for each of its three calls, both widths padded to them."""
    from mxc.compiler.lower import megablox
    from mxc.compiler.lower.megablox import grouped_matmul

    if tiles is not None:
        monkeypatch.setattr(megablox, "tiling", lambda *args: megablox.Tiling(*tiles, 384, 384))
    rows = jax.random.normal(jax.random.key(0), (200, 384), jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), (4, 384, 256), jnp.float32) / 16
    sizes = jnp.array([70, 0, 90, 20], jnp.int32)  # 180 of 200 rows grouped; the rest are zero

    def run(matmul):
        return jax.jit(jax.value_and_grad(lambda r, k: jnp.sum(jnp.sin(matmul(r, k))), argnums=(0, 1)))(rows, kernel)

    value, grads = run(lambda r, k: grouped_matmul(r, k, sizes, jnp.zeros((), jnp.int32), True))
    expected, expected_grads = run(lambda r, k: jnp.where((jnp.arange(200) < 180)[:, None],
                                                          jax.lax.ragged_dot(r, k, sizes), 0))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for g, r in zip(grads, expected_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def _expected_drops(experts: np.ndarray, slots: int) -> np.ndarray:
    """Which assignments [batch, seq, top_k] fit: per sequence, first choices queue before second
    choices, earlier tokens before later ones, and an expert takes `slots` of them."""
    batch, seq, top_k = experts.shape
    kept = np.zeros(experts.shape, bool)
    for b in range(batch):
        taken = {}
        for k in range(top_k):
            for s in range(seq):
                e = experts[b, s, k]
                kept[b, s, k] = taken.get(e, 0) < slots
                taken[e] = taken.get(e, 0) + 1
    return kept


@pytest.mark.parametrize("name", ["mixtral", "llama4", "gpt_oss"])
def test_capacity_path_drops_what_does_not_fit(name):
    moe, params, x = _layer(name)
    batch, seq, _ = x.shape
    factor = 0.5
    slots = capacity(seq, moe.top_k, moe.experts, factor)
    y, stats = moe_layer(moe, params, x, MoEConfig(path="capacity", capacity_factor=factor))
    routing = route(moe, params["router"], x.reshape(-1, D_MODEL))
    kept = _expected_drops(np.asarray(routing.experts).reshape(batch, seq, moe.top_k), slots)
    assert 0 < float(stats.dropped) == float((~kept).sum())
    # The dropped assignments contribute nothing, the kept ones what the dense path gives them. (A
    # zero weight also silences Llama 4's bias-free experts, which see weight · x.)
    keep_mask = jnp.asarray(kept.reshape(-1, moe.top_k))
    only_kept = Routing(routing.experts, routing.weights * keep_mask, routing.probs)
    expected = moe_lib._dense(moe, params["experts"], x.reshape(-1, D_MODEL), only_kept, MoEConfig(), batch)[0]
    expected = expected.reshape(x.shape)
    if moe.shared_experts:
        from mxc.compiler.lower.ffn import ffn_layer
        from mxc.compiler.lower.params import shared_expert_ffn
        expected = expected + ffn_layer(shared_expert_ffn(moe), params["shared"], x)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_capacity_is_a_fair_share_times_the_factor():
    assert capacity(seq=64, top_k=2, experts=8, factor=1.25) == 20
    assert capacity(seq=1, top_k=2, experts=8, factor=1.25) == 1  # decoding one token drops nothing
    assert capacity(seq=10, top_k=2, experts=4, factor=100.0) == 10  # never more than every token


def test_load_balancing_loss_is_one_when_balanced_and_grows_with_collapse():
    uniform = moe_lib.load_balancing_loss(jnp.full(4, 0.25), jnp.array([2.0, 2.0, 2.0, 2.0]))
    assert float(uniform) == pytest.approx(1.0)
    # Top-2 collapsed onto experts 0 and 1, which also hold all the probability.
    collapsed = moe_lib.load_balancing_loss(jnp.array([0.5, 0.5, 0.0, 0.0]), jnp.array([4.0, 4.0, 0.0, 0.0]))
    assert float(collapsed) == pytest.approx(2.0)
    # Top-1 onto one expert: the loss reaches the expert count.
    assert float(moe_lib.load_balancing_loss(jnp.array([1.0, 0, 0, 0]), jnp.array([8.0, 0, 0, 0]))) == 4.0


# ---------------------------------------------------------------- parameters

def test_parameter_counts_match_the_analysis_for_every_zoo_model():
    """Every zoo model's lowered parameter tree holds exactly the parameters the analysis counts
    (DeepSeek V3's correction biases aside: HF keeps them as buffers, not parameters)."""
    from mxc.compiler.analysis import summarize
    from mxc.compiler.lower.params import UnsupportedError, param_shapes
    from mxc.spec.load import load_model, zoo_names

    lowered = []
    for name in zoo_names():
        spec = load_model(name)
        try:
            shapes = param_shapes(spec)
        except UnsupportedError:
            continue
        flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
        sizes = {"main": 0, "mtp": 0}
        for path, leaf in flat:
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            if keys[-1] != "correction_bias":
                sizes["mtp" if keys[0] == "mtp" else "main"] += math.prod(leaf.shape)
        summary = summarize(spec)
        assert sizes["main"] == summary.total_params, name
        assert sizes["mtp"] == summary.mtp_params, name
        lowered.append(name)
    for moe_model in ("mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b",
                      "gpt-oss-120b", "llama4-17b-16e", "llama4-17b-128e", "moe-tiny"):
        assert moe_model in lowered


def test_experts_carry_the_experts_axis():
    from mxc.compiler.lower.params import param_axes
    from mxc.spec.load import load_model

    axes = param_axes(load_model("llama4-17b-128e"))
    moe_layer_axes = axes["segments"][0][1]["mlp"]
    assert moe_layer_axes["experts"]["gate"]["kernel"] == ("layers", "experts", "embed", "mlp")
    assert moe_layer_axes["experts"]["down"]["kernel"] == ("layers", "experts", "mlp", "embed")
    assert moe_layer_axes["shared"]["gate"]["kernel"] == ("layers", "embed", "mlp")


# ---------------------------------------------------------------- sharded over 8 devices

def _run_on_8_devices(checks: str) -> None:
    """tests/children/moe_sharded.py CHECKS on 8 virtual CPU devices, which must be set before jax
    is imported: hence a process of its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = cpu_env(8, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(child("moe_sharded", checks), capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and "sharded ok" in result.stdout, result.stderr[-4000:]


def test_paths_agree_with_experts_sharded_over_8_devices():
    """On a (data 2, expert 4) mesh with experts sharded over `expert`, the dropless and capacity
    paths give the single-device dense reference's outputs and statistics."""
    _run_on_8_devices("paths")


@pytest.mark.slow
def test_gradients_and_a_whole_model_agree_with_experts_sharded_over_8_devices():
    _run_on_8_devices("training")


def test_megablox_compiles_for_tpu_without_the_dense_flops():
    """Compiled for a TPU slice (libtpu's descriptions of v5e:2x2 and v5p:2x2x1), the dropless
    path's dispatch compiles with a ragged all-to-all, and with megablox costs a fraction of XLA's
    ragged_dot, which runs every local expert over every row: the reason TPU plans pick megablox."""
    pytest.importorskip("libtpu")
    result = subprocess.run(child("moe_tpu_flops"), capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0 and "tpu ok" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]


def test_a_dropless_expert_parallel_artifact_compiles_for_tpu(tmp_path):
    """`mxc compile` of a plan that splits the experts writes the artifact: its StableHLO export
    keeps the ragged all-to-all (a custom call jax.export refuses unless told), and megablox takes
    widths that are not a multiple of the TPU lane (moe-tiny's 64 and 96)."""
    pytest.importorskip("libtpu")
    from artifact_builds import run_mxc

    done = run_mxc(tmp_path, "compile", "moe-tiny", "--topology", "v5p-8", "--pin", "expert=4",
                   "--functions", "train_step", "-o", str(tmp_path / "artifact"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert b"ragged_all_to_all" in (tmp_path / "artifact" / "train_step.stablehlo").read_bytes()


# ---------------------------------------------------------------- training

def _permutation_batches(vocab, batch, seq, steps, seed=0):
    """Sequences that follow a fixed random permutation of the vocabulary: learnable to ~0 loss."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)
    for _ in range(steps):
        rows = np.empty((batch, seq + 1), np.int64)
        rows[:, 0] = rng.integers(0, vocab, batch)
        for i in range(seq):
            rows[:, i + 1] = successor[rows[:, i]]
        yield rows


def _biased_moe_tiny():
    """moe-tiny with a router bias, to start it collapsed onto expert 0."""
    from mxc.spec.load import load_model

    spec = load_model("moe-tiny")
    blocks = {name: block.model_copy(update={"mlp": block.mlp.model_copy(update={
        "router": block.mlp.router.model_copy(update={"bias": True})})}) for name, block in spec.blocks.items()}
    return spec.model_copy(update={"blocks": blocks, "compute_dtype": "float32"})


def _train(spec, moe_config, steps, collapse_bias=None, learning_rate=1e-2):
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import batch_from_sequences, init_train_state, make_train_step

    config = OptimizerConfig(learning_rate=learning_rate, total_steps=steps + 10, warmup_steps=10, weight_decay=0.0)
    state = init_train_state(spec, config, jax.random.key(0))
    if collapse_bias is not None:
        segments = jax.tree.map(lambda x: x, state.params["segments"])
        for layer in segments[0]:
            layer["mlp"]["router"]["bias"] = jnp.broadcast_to(collapse_bias, layer["mlp"]["router"]["bias"].shape)
        state = state._replace(params={**state.params, "segments": segments})
    step = jax.jit(make_train_step(spec, config, moe=moe_config, remat="full"))
    history = []
    for rows in _permutation_batches(spec.vocab, 8, 32, steps):
        state, metrics = step(state, batch_from_sequences(jnp.asarray(rows)))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def _load_shares(spec, params, moe_config):
    """Each MoE layer's share of assignments per expert, on fresh data."""
    from mxc.compiler.lower.model import forward_with_aux

    rows = next(_permutation_batches(spec.vocab, 8, 32, 1, seed=7))
    _, _, stats = forward_with_aux(spec, params, jnp.asarray(rows[:, :-1]), moe=moe_config)
    loads = np.asarray(stats[0][0].expert_load)  # [layers, experts]
    return loads / loads.sum(axis=-1, keepdims=True)


@pytest.mark.slow
def test_moe_tiny_trains_and_the_aux_loss_keeps_experts_in_use():
    """From a router biased onto expert 0 (every token's first choice), training with the
    load-balancing loss spreads the load over the experts while the language-model loss falls
    well below log(vocab); the same run without it stays collapsed."""
    spec = _biased_moe_tiny()
    collapse = jnp.array([3.0, 0.0, 0.0, 0.0])
    balanced_state, balanced = _train(spec, MoEConfig(aux_loss_weight=0.1), 150, collapse)
    collapsed_state, _ = _train(spec, MoEConfig(aux_loss_weight=0.0), 150, collapse)
    assert np.median([h["cross_entropy"] for h in balanced[-10:]]) < 0.25 * math.log(spec.vocab)
    assert balanced[-1]["aux_loss"] < balanced[0]["aux_loss"]
    with_aux = _load_shares(spec, balanced_state.params, MoEConfig())
    without = _load_shares(spec, collapsed_state.params, MoEConfig())
    # top-2 of 4 experts: a perfectly balanced layer gives each 1/4; expert 0 on every token, 1/2.
    assert with_aux.max() < 0.35 and with_aux.min() > 0.15, with_aux
    assert without[:, 0].min() > 0.45, without


def _deepseek_tiny(bias_rate, aux_loss_weight=0.01):
    """moe-tiny routed DeepSeek V3's way: sigmoid scores, 2 groups, a correction bias."""
    from mxc.spec.load import load_text

    text = """
    model ds-tiny extends moe-tiny {
      compute_dtype = float32
      block x 2 {
        mlp = moe(experts = 8, top_k = 2, expert = glu(hidden = 32, act = silu),
                  router = router(score = sigmoid, normalize = true, groups = 2, top_groups = 1,
                                  correction_bias = true, routed_scale = 2.0))
      }
    }
    """
    return load_text(text, "ds-tiny.mspec")["ds-tiny"], MoEConfig(bias_update_rate=bias_rate,
                                                                   aux_loss_weight=aux_loss_weight)


def test_train_step_adds_the_aux_loss_and_moves_correction_biases_against_the_load():
    """The step's loss is cross entropy plus the weighted load-balancing loss, and the step moves
    every correction bias by exactly ±rate: down where an expert took more than the mean load, up
    where it took less (not by the optimizer: its gradient is zero). Over two microbatches."""
    from mxc.compiler.lower.model import forward_with_aux
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import batch_from_sequences, init_train_state, make_train_step

    spec, moe_config = _deepseek_tiny(0.01, aux_loss_weight=0.5)
    config = OptimizerConfig(learning_rate=1e-3, total_steps=10, warmup_steps=0)
    state = init_train_state(spec, config, jax.random.key(0))
    rows = jnp.asarray(next(_permutation_batches(spec.vocab, 4, 16, 1)))
    batch = batch_from_sequences(rows)
    _, _, stats = forward_with_aux(spec, state.params, batch["inputs"], moe=moe_config)
    load = np.asarray(stats[0][0].expert_load)  # [layers, experts]
    new_state, metrics = jax.jit(make_train_step(spec, config, moe=moe_config, microbatches=2))(state, batch)
    # A fresh router's loss is about 1, weighted by 0.5.
    assert 0.4 < float(metrics["aux_loss"]) < 1.0
    assert float(metrics["loss"]) == pytest.approx(float(metrics["cross_entropy"] + metrics["aux_loss"]), rel=1e-6)
    before = np.asarray(state.params["segments"][0][0]["mlp"]["router"]["correction_bias"])
    after = np.asarray(new_state.params["segments"][0][0]["mlp"]["router"]["correction_bias"])
    expected = 0.01 * np.sign(load.mean(axis=-1, keepdims=True) - load)
    assert np.abs(expected).sum() > 0
    np.testing.assert_allclose(after - before, expected, atol=1e-7)


def test_bias_updates_balance_a_skewed_router():
    """Repeated bias updates alone (no gradient) bring a router skewed onto two experts to balance."""
    from mxc.compiler.lower.model import forward_with_aux
    from mxc.compiler.lower.params import init_params

    spec, moe_config = _deepseek_tiny(0.05)
    params = init_params(spec, jax.random.key(0), 0.1)
    skew = jnp.zeros(8).at[:2].set(1.0)
    params["segments"][0][0]["mlp"]["router"]["correction_bias"] = jnp.broadcast_to(skew, (2, 8))
    tokens = jnp.asarray(next(_permutation_batches(spec.vocab, 8, 32, 1))[:, :-1])
    step = jax.jit(lambda p: forward_with_aux(spec, p, tokens, moe=moe_config)[2])

    def max_share(stats):
        load = np.asarray(stats[0][0].expert_load)
        return (load / load.sum(-1, keepdims=True)).max()

    stats = step(params)
    assert max_share(stats) > 0.4
    for _ in range(60):
        params = moe_lib.update_correction_biases(spec, params, moe_lib.expert_loads(stats), 0.05)
        stats = step(params)
    assert max_share(stats) < 0.25
