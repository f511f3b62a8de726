"""The parallel block (`parallel = true`): one norm of the layer's input, which attention and the
feed-forward both read, their outputs added to the residual together.

Numerics against HF transformers' Falcon with parallel_attn (one input LayerNorm, the same
x + attn(n) + mlp(n)), on CPU: logits, the loss and every gradient; greedy decoding with the KV
cache against the full forward. Under sequence parallelism the normed input is gathered once per
layer (a child process on 4 virtual CPU devices).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from artifact_builds import child_report
from mxc.compiler.analysis import summarize
from mxc.compiler.hf.config_out import config_from_spec
from mxc.compiler.hf.mapping import LayoutError
from mxc.compiler.lower.decode import decode_step, init_cache, prefill
from mxc.compiler.lower.loss import cross_entropy_loss
from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import param_shapes
from mxc.spec.load import load_text

HEADS, HEAD_DIM, D, HIDDEN, LAYERS, VOCAB, EPS = 4, 8, 32, 64, 2, 128, 1e-5

SPEC = f"""
model falcon-tiny {{
  vocab = {VOCAB}
  d_model = {D}
  max_seq = 64
  embedding = embedding(tied = true)
  final_norm = layernorm(eps = {EPS})
  param_dtype = float32
  compute_dtype = float32
  block x {LAYERS} {{
    attention = mha(heads = {HEADS}, head_dim = {HEAD_DIM}, rope = rope(theta = 10000))
    mlp = mlp(hidden = {HIDDEN}, act = gelu)
    norm = layernorm(eps = {EPS})
    parallel = true
  }}
}}
"""


def _spec(text: str = SPEC):
    return next(iter(load_text(text).values()))


# ------------------------------------------------------------------ the reference

@pytest.fixture(scope="module")
def falcon():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        ffn_hidden_size=HIDDEN, activation="gelu", layer_norm_epsilon=EPS, parallel_attn=True,
        new_decoder_architecture=False, multi_query=False, bias=False, alibi=False,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their initial ones and zeros, so a mix-up shows
        for name, p in model.named_parameters():
            if "layernorm" in name or "ln_f" in name:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model


def _to_mxc(state: dict) -> dict:
    """Falcon's tensors (torch layout, [out, in]; query_key_value as [heads, 3, head_dim] rows) in
    mxc's parameter tree."""
    def layer(i):
        p = f"transformer.h.{i}."
        qkv = state[p + "self_attention.query_key_value.weight"].reshape(HEADS, 3, HEAD_DIM, D)
        return {"attention_norm": {"scale": state[p + "input_layernorm.weight"],
                                   "bias": state[p + "input_layernorm.bias"]},
                "attention": {name: {"kernel": qkv[:, j].transpose(2, 0, 1)} for j, name in enumerate("qkv")}
                | {"o": {"kernel": state[p + "self_attention.dense.weight"].T.reshape(HEADS, HEAD_DIM, D)}},
                "mlp": {"up": {"kernel": state[p + "mlp.dense_h_to_4h.weight"].T},
                        "down": {"kernel": state[p + "mlp.dense_4h_to_h.weight"].T}}}

    layers = [layer(i) for i in range(LAYERS)]
    stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *layers)
    return {"embed": {"embedding": jnp.asarray(state["transformer.word_embeddings.weight"])},
            "segments": [[stacked]],
            "final_norm": {"scale": jnp.asarray(state["transformer.ln_f.weight"]),
                           "bias": jnp.asarray(state["transformer.ln_f.bias"])}}


def _numpy_state(model, grads: bool = False) -> dict:
    return {name: (p.grad if grads else p).detach().numpy().copy() for name, p in model.named_parameters()}


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


def test_the_parameter_tree_is_falcons():
    spec = _spec()
    shapes = param_shapes(spec)
    layer = shapes["segments"][0][0]
    assert "mlp_norm" not in layer and set(layer) == {"attention_norm", "attention", "mlp"}


def test_logits_loss_and_gradients_equal_falcon_with_parallel_attention(falcon):
    import torch

    spec = _spec()
    params = _to_mxc(_numpy_state(falcon))
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda s: s.shape, param_shapes(spec))
    tokens = _tokens((2, 16))

    falcon.zero_grad()
    out = falcon(torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(tokens, dtype=torch.long))
    out.loss.backward()
    reference_logits = out.logits.detach().numpy()

    def loss(p):
        logits = forward(spec, p, jnp.asarray(tokens))[0]
        return cross_entropy_loss(logits[:, :-1], jnp.asarray(tokens[:, 1:]))[0], logits

    (mine_loss, mine_logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    scale = np.abs(reference_logits).max()
    assert np.abs(np.asarray(mine_logits) - reference_logits).max() < 1e-5 * scale
    assert float(mine_loss) == pytest.approx(out.loss.item(), rel=1e-6)
    reference_grads = _to_mxc(_numpy_state(falcon, grads=True))
    for (path, mine), ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree_util.tree_leaves(reference_grads)):
        ref = np.asarray(ref)
        assert np.abs(ref).max() > 1e-4, jax.tree_util.keystr(path)  # every gradient is a real signal
        assert np.abs(np.asarray(mine) - ref).max() < 1e-4 * np.abs(ref).max(), jax.tree_util.keystr(path)


def test_the_sequential_block_differs_from_falcons(falcon):
    # The comparison above can fail: the same weights in mxc's sequential block (with the pre-MLP
    # norm set to the input norm) give other logits.
    import torch

    spec = _spec(SPEC.replace("parallel = true", ""))
    params = _to_mxc(_numpy_state(falcon))
    params["segments"][0][0]["mlp_norm"] = params["segments"][0][0]["attention_norm"]
    tokens = _tokens((1, 8))
    with torch.no_grad():
        reference = falcon(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    mine = np.asarray(forward(spec, params, jnp.asarray(tokens))[0])
    assert np.abs(mine - reference).max() > 1e-2 * np.abs(reference).max()


def test_greedy_decode_with_the_cache_equals_the_full_forward(falcon):
    import torch

    spec = _spec()
    params = _to_mxc(_numpy_state(falcon))
    prompt, new = _tokens((2, 6), seed=1), 8
    cache = init_cache(spec, 2, prompt.shape[1] + new)
    logits, cache = jax.jit(lambda p, t, c: prefill(spec, p, t, c))(params, jnp.asarray(prompt), cache)
    step = jax.jit(lambda p, t, c: decode_step(spec, p, t, c))
    sequence, steps = prompt, []
    for _ in range(new):
        steps.append(np.asarray(logits))
        token = np.argmax(steps[-1], axis=-1).astype(np.int32)
        sequence = np.concatenate([sequence, token[:, None]], axis=1)
        logits, cache = step(params, jnp.asarray(token), cache)
    full = np.asarray(jax.jit(lambda p, t: forward(spec, p, t)[0])(params, jnp.asarray(sequence)))
    cached = np.stack(steps, axis=1)
    assert np.abs(cached - full[:, prompt.shape[1] - 1:-1]).max() < 1e-5 * np.abs(full).max()
    with torch.no_grad():  # and the same tokens as transformers' own greedy generation
        hf = falcon.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, attention_mask=torch.ones(prompt.shape, dtype=torch.long))
    np.testing.assert_array_equal(sequence, hf.numpy())


# ------------------------------------------------------------------ counts, checks, export

def test_a_parallel_block_counts_one_norm_less_per_layer():
    parallel, sequential = _spec(), _spec(SPEC.replace("parallel = true", ""))
    norm = 2 * D  # LayerNorm: scale and bias
    assert summarize(sequential).total_params - summarize(parallel).total_params == LAYERS * norm
    leaves = jax.tree_util.tree_leaves(param_shapes(parallel))
    assert sum(int(np.prod(s.shape)) for s in leaves) == summarize(parallel).total_params
    assert summarize(parallel).train_flops_per_token == summarize(sequential).train_flops_per_token


def test_parallel_is_left_out_of_the_resolved_ir_when_false():
    assert "parallel" not in _spec(SPEC.replace("parallel = true", "")).model_dump()["blocks"]["block"]
    assert _spec().model_dump()["blocks"]["block"]["parallel"] is True


@pytest.mark.parametrize("line, message", [
    ("post_norm = rmsnorm(eps = 1e-5)", "a parallel block takes no post_norm"),
    ('parallel = "yes"', "must be true or false"),
])
def test_nonsense_is_an_error_at_its_place(tmp_path, line, message):
    from mxc.spec.diagnostics import SpecError

    text = SPEC.replace("parallel = true", "parallel = true\n    " + line) if "post_norm" in line \
        else SPEC.replace("parallel = true", line)
    with pytest.raises(SpecError) as err:
        load_text(text)
    rendered = str(err.value)
    assert message in rendered
    wanted = line.split(" = ")[0]
    where = next(i for i, l in enumerate(text.splitlines(), 1) if l.strip().startswith(wanted))
    assert f":{where}:" in rendered and "^" in rendered


def test_a_vision_towers_encoder_block_cannot_be_parallel(capsys):
    from mxc.compiler.cli import main

    assert main(["check", "gemma3-4b", "--set", "vision.block.parallel=true"]) == 1
    assert "encoder block cannot be parallel" in capsys.readouterr().err


def test_export_refuses_a_parallel_block():
    with pytest.raises(LayoutError, match="parallel"):
        config_from_spec(_spec())


def test_the_memory_model_keeps_one_normed_input_in_a_parallel_layer():
    from mxc.compiler.plan.activations import intermediate_bytes
    from mxc.compiler.plan.choice import Choice
    from mxc.compiler.plan.layout import parameters
    from mxc.compiler.plan.plan import MESH_AXES
    from mxc.compiler.plan.rules import make_rules
    from mxc.compiler.topology import parse

    sizes = {}
    for name, text in (("parallel", SPEC), ("sequential", SPEC.replace("parallel = true", ""))):
        spec = _spec(text)
        params = parameters(spec)
        mesh = {axis: 1 for axis in MESH_AXES} | {"fsdp": 8}
        choice = Choice(spec, params, parse("v5p-16"), mesh, {}, make_rules(mesh, params.tensors)[0], 64, 8, 1,
                        "full", "xla")
        sizes[name] = intermediate_bytes("block", choice)
    assert set(sizes["sequential"]) - set(sizes["parallel"]) == {"attention_residual", "mlp_norm_out"}
    assert {k: v for k, v in sizes["sequential"].items() if k in sizes["parallel"]} == sizes["parallel"]


# ------------------------------------------------------------------ sequence parallelism

MESH = {"fsdp": 2, "tensor": 2}
RULES = {"batch": ["data", "fsdp"], "embed": ["fsdp"], "vocab": ["tensor"], "heads": ["tensor"],
         "kv_heads": ["tensor"], "mlp": ["tensor"], "residual_seq": ["tensor"]}


def _child() -> dict:
    """4 virtual devices: one parallel and one sequential layer's forward under sequence
    parallelism, against one device, and the all-gathers of activations each compiles to."""
    import re

    from jax.sharding import Mesh

    from mxc.compiler.lower.params import init_params, param_axes
    from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(MESH["fsdp"], MESH["tensor"]), tuple(MESH))
    tokens = jnp.asarray(_tokens((4, 16)))
    report = {}
    for name, text in (("parallel", SPEC), ("sequential", SPEC.replace("parallel = true", ""))):
        spec = _spec(text.replace(f"block x {LAYERS}", "block x 1"))
        params = init_params(spec, jax.random.key(0))
        single = jax.jit(lambda p, t: forward(spec, p, t)[0])(params, tokens)
        sharded_params = jax.device_put(params, tree_shardings(param_axes(spec), mesh, RULES))
        with use_rules(mesh, RULES):
            step = jax.jit(lambda p, t: forward(spec, p, t)[0])
            placed = jax.device_put(tokens, named_sharding(("batch", "seq"), mesh, RULES))
            sharded = step(sharded_params, placed)
            hlo = step.lower(sharded_params, placed).compile().as_text()
        # Activations gathered over the sequence: [batch/fsdp, seq, d_model] results.
        gathers = re.findall(rf"= f32\[2,16,{D}\]\S* all-gather", hlo)

        def loss(p, t):
            logits = forward(spec, p, t)[0]
            return cross_entropy_loss(logits[:, :-1], t[:, 1:])[0]

        single_grads = jax.jit(jax.grad(loss))(params, tokens)
        with use_rules(mesh, RULES):
            sharded_grads = jax.jit(jax.grad(loss))(sharded_params, placed)
        grad_diff = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                        for a, b in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(single_grads)))
        report[name] = {"max_abs_diff": float(jnp.abs(sharded - single).max()),
                        "max_abs": float(jnp.abs(single).max()), "activation_gathers": len(gathers),
                        "grad_relative_diff": grad_diff}
    return report


@pytest.fixture(scope="module")
def sharded():
    return child_report(__file__, timeout=600, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                        JAX_PLATFORMS="cpu")


def test_sequence_parallel_gathers_the_normed_input_once(sharded):
    for case in ("parallel", "sequential"):
        assert sharded[case]["max_abs_diff"] < 1e-5 * sharded[case]["max_abs"], case
        assert sharded[case]["grad_relative_diff"] < 1e-4, case  # the gradients too
    # One layer: the sequential block gathers before attention and before the MLP, the parallel
    # block once; both gather the final hidden states for the vocabulary-split output head.
    assert sharded["sequential"]["activation_gathers"] == 3
    assert sharded["parallel"]["activation_gathers"] == 2


if __name__ == "__main__":
    print(json.dumps(_child()))
