"""The layer-kind registry: a kind defined in this file alone (keys and values from one shared
projection) is picked up by validation, parameter definitions, counts, the planner and the
forward pass; an IR class without a kind is refused with one clear error."""

from __future__ import annotations

import os
from typing import Literal

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.analysis import norm_params, summarize
from mxc.compiler.kinds import AttentionKind, UnregisteredKindError, kind_of, register, unregister
from mxc.compiler.kinds.attention import CACHE_AXES, HEAD_ATTENTION
from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import param_shapes
from mxc.compiler.plan.search import evaluate
from mxc.compiler.topology import parse
from mxc.spec.ir import GQA
from mxc.spec.load import load_text
from mxc.spec.validate import validate

TINY = """
model tiny {
  vocab = 61
  d_model = 32
  max_seq = 32
  embedding = embedding(tied = false)
  final_norm = rmsnorm(eps = 1e-5)
  compute_dtype = float32
  block b {
    attention = gqa(heads = 4, kv_heads = 2, head_dim = 8, rope = rope(theta = 10000))
    mlp = glu(hidden = 48, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
  layers = b x 2
}
"""


class SharedKV(GQA):
    """Keys serve as values too: one "kv" projection instead of "k" and "v" (position-free keys
    only: a rotated key could not be a value)."""

    kind: Literal["shared_kv"] = "shared_kv"


class SharedKVKind(AttentionKind):
    """Everything the compiler needs about SharedKV, built on the MHA/GQA kind."""

    ir_classes = (SharedKV,)

    def check(self, att, at, report):
        if att.rope is not None:
            report(at + ("rope",), "shared_kv attention takes rope = none")

    def param_defs(self, att, d_model):
        defs = HEAD_ATTENTION.param_defs(att, d_model)
        defs["kv"] = defs.pop("k")
        del defs["v"]
        return defs

    def param_counts(self, att, d_model):
        qkv, out = self.projection_weights(att, d_model)
        return qkv + out + 2 * norm_params(att.qk_norm, att.head_dim), qkv + out

    def projection_weights(self, att, d_model):
        return d_model * (att.heads + att.kv_heads) * att.head_dim, att.heads * att.head_dim * d_model

    def value_head_dim(self, att):
        return att.head_dim

    def cache_entries(self, att, batch, length):
        return {"kv": ((batch, length, att.kv_heads, att.head_dim), CACHE_AXES)}

    def apply(self, att, params, x, positions, *, cache=None, **rest):
        head_params = {**{k: v for k, v in params.items() if k != "kv"}, "k": params["kv"], "v": params["kv"]}
        head_cache = None if cache is None else {"k": cache["kv"], "v": cache["kv"]}
        y, new_cache = HEAD_ATTENTION.apply(att, head_params, x, positions, cache=head_cache, **rest)
        return y, None if new_cache is None else {"kv": new_cache["k"]}


def _with_attention(spec, cls, **update):
    """`spec` with every block's attention turned into `cls` (built without the IR's union, as a
    new kind's grammar rule would)."""
    blocks = {}
    for name, block in spec.blocks.items():
        fields = {**block.attention.model_dump(), **update}
        fields.pop("kind")
        blocks[name] = block.model_copy(update={"attention": cls(**fields)})
    return spec.model_copy(update={"blocks": blocks})


@pytest.fixture
def shared_kv():
    kind = register(SharedKVKind())
    yield
    unregister(kind)


def _random_params(spec):
    rng = np.random.default_rng(0)

    def draw(path, shape):
        centre = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(centre + 0.3 * rng.normal(size=shape.shape), shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(spec))


# The IR's Attention union (the grammar's side of a kind) does not list SharedKV, so pydantic
# warns when the plan hashes the spec; it then serialises the node field by field.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_a_kind_registered_outside_the_compiler_serves_validation_counts_params_and_apply(shared_kv):
    base = _with_attention(load_text(TINY)["tiny"], GQA, rope=None)
    spec = _with_attention(base, SharedKV)
    att = spec.blocks["b"].attention
    assert kind_of(att).__class__ is SharedKVKind

    problems = []
    validate(_with_attention(load_text(TINY)["tiny"], SharedKV), lambda path, message, hint=None:
             problems.append((path, message)))
    assert problems == [(("blocks", "b", "attention", "rope"), "shared_kv attention takes rope = none")]
    problems.clear()
    validate(spec, lambda path, message, hint=None: problems.append((path, message)))
    assert problems == []

    # Counts: the base model less one [d_model, kv_heads, head_dim] projection per layer.
    v_weights = spec.d_model * att.kv_heads * att.head_dim
    assert summarize(spec).total_params == summarize(base).total_params - spec.num_layers * v_weights
    shapes = param_shapes(spec)
    assert set(shapes["segments"][0][0]["attention"]) == {"q", "kv", "o"}
    assert sum(x.size for x in jax.tree.leaves(shapes)) == summarize(spec).total_params

    # The planner's memory and time read the kind: half the base model's KV cache.
    plans = [evaluate(s, parse("v5e-8"), seq=32, batch=8, mesh={"fsdp": 8}, remat="full") for s in (spec, base)]
    assert plans[0].serving_kv_cache * 2 == plans[1].serving_kv_cache
    assert plans[0].predicted.parameters < plans[1].predicted.parameters

    # Apply: the same as the base model whose keys and values are both the shared projection.
    params = _random_params(spec)
    base_params = jax.tree.map(lambda x: x, params)
    for period in base_params["segments"]:
        for layer in period:
            kv = layer["attention"].pop("kv")
            layer["attention"].update(k=kv, v=kv)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, spec.vocab, (2, 9)), jnp.int32)
    logits, _ = forward(spec, params, tokens)
    expected, _ = forward(base, base_params, tokens)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


class Unregistered(GQA):
    kind: Literal["unregistered"] = "unregistered"


def test_an_ir_class_without_a_kind_is_one_clear_error():
    spec = _with_attention(load_text(TINY)["tiny"], Unregistered)
    with pytest.raises(UnregisteredKindError, match=r"no layer kind is registered for Unregistered "
                                                    r"\(kind 'unregistered'\)"):
        kind_of(spec.blocks["b"].attention)
    with pytest.raises(UnregisteredKindError, match="Unregistered"):
        summarize(spec)
    with pytest.raises(UnregisteredKindError, match="Unregistered"):
        param_shapes(spec)


def test_every_ir_class_of_the_unions_has_a_kind():
    from typing import get_args

    from mxc.spec.ir import FFN, Attention

    for union in (Attention, FFN):
        for cls in get_args(get_args(union)[0]):
            assert kind_of(cls.model_construct()).ir_classes.count(cls) == 1


@pytest.mark.parametrize("update, field", [
    ({"top_k": 9}, ("top_k",)),
    ({"router": {"groups": 3}}, ("router", "groups")),
    ({"router": {"groups": 4, "top_groups": 5}}, ("router", "top_groups")),
    ({"top_k": 5, "router": {"groups": 4, "top_groups": 2}}, ("top_k",)),
])
def test_the_lowering_refuses_a_mixture_of_experts_with_the_message_validation_reports(update, field):
    """One set of MoE rules: what validation reports at a field, the parameter builder refuses."""
    from mxc.compiler.lower.params import UnsupportedError, moe_defs
    from mxc.spec.ir import GLU, MoE, Router

    fields = {"experts": 8, "top_k": 2, "expert": GLU(hidden=16, act="silu"),
              "router": {"score": "softmax", "normalize": True}}
    fields.update({k: v for k, v in update.items() if k != "router"})
    fields["router"] = Router(**fields["router"], **update.get("router", {}))
    moe = MoE(**fields)
    problems = []
    kind_of(moe).check(moe, ("mlp",), lambda path, message, hint=None: problems.append((path, message)))
    assert [path for path, _ in problems] == [("mlp", *field)]
    with pytest.raises(UnsupportedError) as refused:
        moe_defs(moe, 32)
    assert str(refused.value) == problems[0][1]


def test_a_registered_kind_states_its_kv_cache(shared_kv):
    """Prefill and decode run on the cache entries the kind states (one "kv" array), and give the
    full forward pass's logits."""
    from mxc.compiler.lower.decode import cache_axes, decode_step, init_cache, prefill

    spec = _with_attention(load_text(TINY)["tiny"], SharedKV, rope=None)
    params = _random_params(spec)
    cache = init_cache(spec, 2, 12)
    assert set(cache["segments"][0][0]) == {"kv"}
    assert cache_axes(spec)["segments"][0][0] == {"kv": ("layers", *CACHE_AXES)}
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, spec.vocab, (2, 9)), jnp.int32)
    full, _ = forward(spec, params, tokens)
    last, cache = prefill(spec, params, tokens[:, :6], cache)
    np.testing.assert_allclose(last, full[:, 5], rtol=1e-5, atol=1e-5)
    for i in range(6, 9):
        logits, cache = decode_step(spec, params, tokens[:, i], cache)
        np.testing.assert_allclose(logits, full[:, i], rtol=1e-5, atol=1e-5)
