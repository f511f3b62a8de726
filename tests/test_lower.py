"""The layer library: parameters, the scanned forward pass, KV-cache decoding and sampling, each
checked against an independent computation (a python loop, a numpy reference, the analysis)."""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.analysis import summarize
from mxc.compiler.lower.attention_core import EMPTY_SLOT, attend
from mxc.compiler.lower.block import block_layer
from mxc.compiler.lower.decode import decode_step, init_cache, prefill
from mxc.compiler.lower.model import CHECKPOINT_NAMES, embed, forward, logits_from_hidden
from mxc.compiler.lower.params import init_params, layer_slots, param_axes, param_shapes
from mxc.compiler.lower.rope import frequencies
from mxc.spec.ir import LOGICAL_AXES, MESH_AXES, MoE, MLA, LinearScaling, Llama3Scaling, Rope, YarnScaling
from mxc.spec.load import load_model, load_text, zoo_names

# Two block kinds in a pattern with a remainder, so the forward pass runs three scans; between
# them: GQA and MHA, window, chunk, soft-cap, sinks, QK-norm, post-norms, YaRN, NoPE with
# temperature tuning, LayerNorm, GLU, MLP and clamped SwiGLU.
MIXED = """
model mixed {
  vocab = 97
  d_model = 32
  max_seq = 64
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  final_softcap = 4.0
  compute_dtype = float32
  block local {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 8, window = 5, softcap = 3.0, sinks = true,
                    rope = rope(theta = 10000))
    mlp = glu(hidden = 48, act = silu)
    norm = rmsnorm(eps = 1e-5)
    post_norm = rmsnorm(eps = 1e-5, zero_centered = true)
  }
  block global {
    attention = mha(heads = 4, head_dim = 8, qk_norm = rmsnorm(eps = 1e-5), qkv_bias = true,
                    rope = rope(theta = 500000, scaling = yarn(factor = 4, original_max_seq = 16)))
    mlp = mlp(hidden = 48, act = gelu, bias = true)
    norm = layernorm(eps = 1e-5)
  }
  block chunked {
    attention = gqa(heads = 4, kv_heads = 1, head_dim = 8, chunk = 4, rope = none,
                    temperature_tuning = temperature_tuning(floor_scale = 4, attn_scale = 0.5))
    mlp = clamped_swiglu(hidden = 48, alpha = 1.702, limit = 1.5)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = (local x 2, global) x 2, chunked, local
}
"""


@pytest.fixture(scope="module")
def mixed():
    spec = load_text(MIXED)["mixed"]
    return spec, _random_params(spec)


def _random_params(spec, std=0.3):
    """Every parameter drawn at random (norm scales around 1), so that mixing any two up shows.
    Drawn with numpy: compiling init_params for this many shapes would cost more than the tests."""
    rng = np.random.default_rng(0)

    def draw(path, shape):
        centre = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(centre + std * rng.normal(size=shape.shape), shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(spec))


def _tokens(shape, vocab, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= tol * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


# ------------------------------------------------------------------ parameters

def test_param_counts_equal_the_analysis_for_every_zoo_model():
    # Every family lowers (dense, MoE, MLA, MTP); the lowered tree holds exactly what the
    # analysis counts, MTP modules included. DeepSeek V3's routing correction bias is state the
    # training step updates, not a learned weight (a buffer in the reference), so it is not counted.
    for name in zoo_names():
        spec = load_model(name)
        leaves = jax.tree_util.tree_flatten_with_path(param_shapes(spec))[0]
        count = sum(int(np.prod(s.shape)) for path, s in leaves
                    if "correction_bias" not in jax.tree_util.keystr(path))
        summary = summarize(spec)
        assert count == summary.total_params + summary.mtp_params, name


def test_every_parameter_has_one_logical_axis_per_dimension(mixed):
    spec, _ = mixed
    shapes = param_shapes(spec)
    axes = param_axes(spec)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))[0])
    flat_shapes = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
    assert flat_axes.keys() == flat_shapes.keys()
    for path, shape in flat_shapes.items():
        names = flat_axes[path]
        assert len(names) == len(shape.shape), path
        assert all(n is None or n in LOGICAL_AXES for n in names), path
        stacked = jax.tree_util.keystr(path).startswith("['segments']")
        assert (names[0] == "layers") == stacked, path
    assert shapes["segments"][0][0]["attention"]["q"]["kernel"].shape == (2, 32, 4, 8)
    assert axes["segments"][0][0]["attention"]["k"]["kernel"] == ("layers", "embed", "kv_heads", "head_dim")


def test_init_params_follow_the_reference_initialisers():
    spec = load_text(MIXED.replace("layers = (local x 2, global) x 2, chunked, local",
                                   "layers = local, global, chunked"))["mixed"]
    init = jax.jit(lambda key: init_params(spec, key))
    params = init(jax.random.key(3))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == \
        jax.tree.map(lambda s: (s.shape, s.dtype), param_shapes(spec))
    local, glob = params["segments"][0][0], params["segments"][1][0]
    assert bool(jnp.all(local["attention_norm"]["scale"] == 1))
    assert bool(jnp.all(local["attention_post_norm"]["scale"] == 0))  # zero-centred: applied as 1 + w
    assert bool(jnp.all(glob["attention"]["q"]["bias"] == 0))
    assert bool(jnp.all(glob["mlp_norm"]["bias"] == 0))
    assert abs(float(jnp.std(params["embed"]["embedding"])) - 0.02) < 0.002
    again = init(jax.random.key(3))
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))


# ------------------------------------------------------------------ the forward pass

def _loop_forward(spec, params, tokens):
    """The model as a python loop over layers, each sliced out of its stacked segment."""
    x = embed(spec, params, tokens, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for slot in layer_slots(spec):
        layer = jax.tree.map(lambda a: a[slot.repeat], params["segments"][slot.segment][slot.position])
        x, _ = block_layer(spec.blocks[slot.block], layer, x, positions)
    return logits_from_hidden(spec, params, x)


def test_scan_over_segments_equals_a_python_loop_over_layers(mixed):
    spec, params = mixed
    assert [len(s.period) * s.repeat for s in spec.layers] == [6, 1, 1]
    tokens = _tokens((2, 16), spec.vocab)
    scanned, cache = jax.jit(lambda p, t: forward(spec, p, t))(params, tokens)
    assert cache is None and scanned.shape == (2, 16, spec.vocab) and scanned.dtype == jnp.float32
    _close(scanned, jax.jit(lambda p: _loop_forward(spec, p, tokens))(params))


def test_compiled_size_does_not_grow_with_depth():
    def hlo_size(layers):
        spec = load_model("llama3-tiny").model_copy(update={"layers": (
            load_model("llama3-tiny").layers[0].model_copy(update={"repeat": layers}),)})
        args = (param_shapes(spec), jax.ShapeDtypeStruct((2, 16), jnp.int32))
        return len(jax.jit(lambda p, t: forward(spec, p, t)[0]).lower(*args).as_text())

    shallow, deep = hlo_size(2), hlo_size(32)
    assert abs(deep - shallow) < 0.01 * shallow


@pytest.fixture(scope="module")
def tiny():
    spec = load_model("llama3-tiny")
    return spec, _random_params(spec, std=0.1)


def test_remat_policy_keeps_values_and_gradients(tiny):
    spec, params = tiny
    tokens = _tokens((2, 12), spec.vocab)
    policy = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)

    def loss(p, remat):
        logits, _ = forward(spec, p, tokens, remat_policy=remat, dtype="float32")
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    plain, plain_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, None)))(params)
    remat, remat_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, policy)))(params)
    _close(remat, plain)
    for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads)):
        _close(a, b, 1e-4)
    text = str(jax.make_jaxpr(lambda p: forward(spec, p, tokens)[0])(params))
    for name in CHECKPOINT_NAMES:
        assert f"name={name}" in text, name


def test_bfloat16_compute_stays_close_to_float32(tiny):
    spec, params = tiny
    tokens = _tokens((2, 12), spec.vocab)
    exact = jax.jit(lambda p: forward(spec, p, tokens, dtype="float32")[0])(params)
    low = jax.jit(lambda p: forward(spec, p, tokens, dtype="bfloat16")[0])(params)
    assert low.dtype == jnp.float32
    error = float(jnp.abs(low - exact).max() / jnp.abs(exact).max())
    assert 0 < error < 0.15  # bfloat16 really ran, and still computes the same function


# The files of the layer library whose job is mapping logical axes onto the mesh: only they may
# name a mesh axis. Every other file, present or future, is linted.
MESH_MAPPING_FILES = {
    "sharding.py",  # the logical-to-mesh rules themselves (batch -> data, fsdp; ...)
    "pipeline.py",  # places the stage dimension on the stage axis (vmap's spmd_axis_name)
    "remat.py",  # MaxText's checkpoint name "context" (the attention core's output) is not an axis
}


def test_layer_code_names_no_mesh_axis():
    lower = Path(__file__).resolve().parents[1] / "compiler" / "lower"
    files = sorted(lower.rglob("*.py"))
    assert MESH_MAPPING_FILES <= {f.name for f in files}  # an exception for a file gone is stale
    linted = [f for f in files if f.name not in MESH_MAPPING_FILES]
    assert len(linted) > 10
    offenders = [(f.name, axis) for f in linted for axis in MESH_AXES
                 if re.search(rf"[\"']{axis}[\"']", f.read_text())]
    assert not offenders, f"layer code names mesh axes (use logical axes): {offenders}"


# ------------------------------------------------------------------ the attention core

def _numpy_attention(q, k, v, q_pos, kv_pos, *, scale, window=None, chunk=None, softcap=None, sinks=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, seq, heads, _ = q.shape
    groups = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            kh = h // groups
            for i in range(seq):
                scores = k[b, :, kh] @ q[b, i, h] * scale
                if softcap is not None:
                    scores = np.tanh(scores / softcap) * softcap
                qp, kp = q_pos[b, i], kv_pos[b]
                ok = (kp <= qp)
                if window is not None:
                    ok &= kp > qp - window
                if chunk is not None:
                    ok &= kp // chunk == qp // chunk
                weights = np.where(ok, np.exp(scores - scores[ok].max()), 0.0)
                denominator = weights.sum() + (np.exp(sinks[h] - scores[ok].max()) if sinks is not None else 0.0)
                out[b, i, h] = (weights / denominator) @ v[b, :, kh]
    return out


@pytest.mark.parametrize("options", [{}, {"window": 3}, {"chunk": 4}, {"softcap": 0.5},
                                     {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
                                     {"window": 4, "softcap": 1.0, "sinks": np.array([1.0, 0.0, -2.0, 3.0])}])
def test_attend_matches_a_numpy_reference(options):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 6, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 10, 2, 8)).astype(np.float32)
    v = rng.normal(size=(2, 10, 2, 8)).astype(np.float32)
    # Queries at positions 3..8 against a cache of 10 slots whose last is still empty.
    q_pos = np.broadcast_to(np.arange(3, 9), (2, 6))
    kv_pos = np.broadcast_to(np.append(np.arange(9), EMPTY_SLOT), (2, 10))
    got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                 kv_positions=jnp.asarray(kv_pos), scale=0.4,
                 **{n: (jnp.asarray(o) if n == "sinks" else o) for n, o in options.items()})
    _close(got, _numpy_attention(q, k, v, q_pos, kv_pos, scale=0.4, **options))


# ------------------------------------------------------------------ rope

@pytest.mark.parametrize("rope", [
    Rope(theta=10000, scaling=LinearScaling(factor=4)),
    Rope(theta=500000, scaling=Llama3Scaling(factor=8, low_freq=1, high_freq=4, original_max_seq=64)),
    Rope(theta=10000, scaling=YarnScaling(factor=4, original_max_seq=64)),
    Rope(theta=10000, scaling=YarnScaling(factor=40, original_max_seq=64, beta_fast=16, mscale=0.707,
                                          mscale_all_dim=0.707, truncate=False)),
])
def test_rope_frequencies_match_transformers(rope):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = rope.scaling
    params = {"rope_theta": rope.theta, "rope_type": s.kind, "factor": s.factor}
    if isinstance(s, Llama3Scaling):
        params.update(low_freq_factor=s.low_freq, high_freq_factor=s.high_freq,
                      original_max_position_embeddings=s.original_max_seq)
    if isinstance(s, YarnScaling):
        params.update(original_max_position_embeddings=s.original_max_seq, beta_fast=s.beta_fast,
                      beta_slow=s.beta_slow, mscale=s.mscale, mscale_all_dim=s.mscale_all_dim, truncate=s.truncate)
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                      max_position_embeddings=512, rope_parameters=params)
    reference, factor = ROPE_INIT_FUNCTIONS[s.kind](config, "cpu")
    mine, my_factor = frequencies(rope, 64)
    np.testing.assert_allclose(mine, reference.numpy(), rtol=2e-6)
    assert my_factor == pytest.approx(factor, rel=1e-6)


# ------------------------------------------------------------------ decoding

def test_prefill_and_decode_equal_the_full_forward(mixed):
    spec, params = mixed
    tokens = _tokens((2, 14), spec.vocab, seed=1)
    full = jax.jit(lambda p: forward(spec, p, tokens)[0])(params)
    cache = init_cache(spec, 2, 16)
    # The prompt in two chunks, then one token at a time: all the same function with a cache.
    step = jax.jit(lambda p, t, c: forward(spec, p, t, cache=c))
    first, cache = step(params, tokens[:, :4], cache)
    _close(first, full[:, :4])
    last, cache = jax.jit(lambda p, t, c: prefill(spec, p, t, c))(params, tokens[:, 4:7], cache)
    _close(last, full[:, 6])
    decode = jax.jit(lambda p, t, c: decode_step(spec, p, t, c))
    for i in range(7, 14):
        logits, cache = decode(params, tokens[:, i], cache)
        _close(logits, full[:, i])
    assert int(cache["index"]) == 14
    np.testing.assert_array_equal(cache["positions"][0], np.append(np.arange(14), [EMPTY_SLOT] * 2))
