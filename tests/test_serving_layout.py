"""Serving with one array per layer (runtime/layer_layout.py), as CPU serving programs do,
gives the tokens and logits of the stacked layout that checkpoints and training keep."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from mxc.compiler.lower.decode import serving_steps
from mxc.runtime.layer_layout import (all_per_layer, per_layer, per_layer_abstract, per_layer_arrays,
                                             stacked_abstract)
from mxc.compiler.lower.params import init_params
from mxc.spec.load import load_model

MODEL, PROMPT, CACHE, NEW = "llama3-tiny", 5, 16, 6


def _greedy(spec, params, prompt):
    prefill, decode = (jax.jit(f) for f in serving_steps(spec, 1, CACHE, dtype="float32"))
    logits, cache = prefill(params, prompt, np.array([PROMPT], np.int32))
    steps = [logits]
    for _ in range(NEW):
        logits, cache = decode(params, np.argmax(logits, -1).astype(np.int32), cache)
        steps.append(logits)
    return np.stack([np.asarray(s) for s in steps]), cache


def test_per_layer_serving_matches_the_stacked_layers():
    spec = load_model(MODEL)
    params = init_params(spec, jax.random.key(1))
    prompt = np.random.default_rng(0).integers(0, spec.vocab, (1, PROMPT)).astype(np.int32)
    stacked_logits, stacked_cache = _greedy(spec, params, prompt)
    layered = per_layer_arrays(params)
    assert all_per_layer(layered) and not all_per_layer(params)
    layered_logits, layered_cache = _greedy(spec, layered, prompt)
    np.testing.assert_array_equal(np.argmax(layered_logits, -1), np.argmax(stacked_logits, -1))
    np.testing.assert_allclose(layered_logits, stacked_logits, rtol=0, atol=0)
    # The per-layer cache holds what the stacked cache holds, layer by layer.
    restacked = jax.tree.map(lambda *layers: np.stack(layers), *layered_cache["segments"][0])
    for got, want in zip(jax.tree.leaves(restacked), jax.tree.leaves(stacked_cache["segments"][0])):
        np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_the_abstract_layouts_convert_both_ways():
    spec = load_model(MODEL)
    shapes = jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))
    shardings = jax.tree.map(lambda _: None, shapes)
    for joined in (False, True):  # and with each layer's projections joined (layer_layout.joined_block)
        layered, layered_shardings = per_layer_abstract(shapes, shardings, joined=joined)
        arrays = jax.eval_shape(lambda s: per_layer(s, joined), shapes)
        assert jax.tree.structure(layered) == jax.tree.structure(arrays)
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(layered)] == [(a.shape, a.dtype) for a in jax.tree.leaves(arrays)]
        assert jax.tree.structure(layered_shardings, is_leaf=lambda x: x is None) == jax.tree.structure(
            layered, is_leaf=lambda x: x is None)
        back = stacked_abstract(layered)
        assert jax.tree.structure(back) == jax.tree.structure(shapes)
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(back)] == [(a.shape, a.dtype) for a in jax.tree.leaves(shapes)]


def test_cpu_plans_serve_quantized_weights_stacked():
    """One array per layer for float weights (and an int8 KV cache); quantized weights keep the
    stacked scan, whose conversion decoded faster on CPUs (docs/serving.md)."""
    from mxc.compiler.lower.choices import LoweringChoices

    cpu, tpu = LoweringChoices.for_platform("cpu"), LoweringChoices.for_platform("tpu")
    assert cpu.serves_per_layer(None) and cpu.serves_per_layer("fp32") and cpu.serves_per_layer("int8-kv")
    assert not any(cpu.serves_per_layer(name) for name in ("int8", "w8a8", "int4", "bf16", "fp8", "int8+int8-kv"))
    assert not tpu.serves_per_layer(None)


def test_the_cpu_prefill_attends_to_the_prompt_alone():
    """A CPU serving prefill runs the prompt in a cache of its own length, then writes it into the
    full cache (LoweringChoices.prefill_own_keys): the logits and cache of attending to every
    slot of the full cache (to float32 rounding: the softmax sums fewer, empty, slots; the
    positions exactly), with fewer FLOPs."""
    import dataclasses

    from mxc.compiler.lower.choices import LoweringChoices, use_lowering

    spec = load_model(MODEL)
    params = per_layer_arrays(init_params(spec, jax.random.key(2)))
    prompts = np.random.default_rng(1).integers(0, spec.vocab, (2, PROMPT)).astype(np.int32)
    lengths = np.array([PROMPT, 3], np.int32)  # a shorter row: its padding's slots end up empty
    cpu = LoweringChoices.for_platform("cpu")
    results, flops = [], []
    for choices in (cpu, dataclasses.replace(cpu, prefill_own_keys=False)):
        with use_lowering(choices):
            prefill, _ = serving_steps(spec, 2, CACHE, dtype="float32")
            compiled = jax.jit(prefill).lower(params, prompts, lengths).compile()
        results.append(jax.tree.map(np.asarray, compiled(params, prompts, lengths)))
        flops.append(compiled.cost_analysis()["flops"])
    own, every_slot = results
    assert jax.tree.structure(own) == jax.tree.structure(every_slot)
    for got, want in zip(jax.tree.leaves(own), jax.tree.leaves(every_slot)):
        if got.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    assert flops[0] < flops[1], flops


def test_the_cpu_decode_step_reads_the_attention_output_kernel_in_place():
    """The attention output projection contracts heads and head_dim as one row-major matrix
    product (weight_gradients._forward_product): as an einsum, XLA:CPU copied every layer's
    output kernel transposed at every decode step."""
    import re

    spec = load_model(MODEL)
    params = per_layer_arrays(init_params(spec, jax.random.key(0)))
    prefill, decode = serving_steps(spec, 1, CACHE, dtype="float32")
    prompt = np.zeros((1, PROMPT), np.int32)
    cache = jax.eval_shape(prefill, params, prompt, np.array([PROMPT], np.int32))[1]
    hlo = jax.jit(decode).lower(params, np.zeros(1, np.int32), cache).compile().as_text()
    kernels = re.findall(r"%(\S*attention\S*_o_\S*kernel\S*) = f32\S* parameter", hlo)
    assert len(kernels) == spec.layers[0].repeat, kernels  # one per layer, found by name
    copies = [k for k in kernels if re.search(rf"fusion\(%{re.escape(k)}\), kind=kLoop", hlo)]
    assert not copies, copies


# SmolLM2-135M's layer shape (bench/runtime_common.py's preset) in two layers and a small vocabulary,
# and a Qwen2.5-like model whose q/k/v have biases.
SMOLLM2_SHAPED = """
model smollm2-shaped {
  vocab = 512
  d_model = 576
  max_seq = 256
  embedding = embedding(tied = true)
  final_norm = rmsnorm(eps = 1e-5)
  param_dtype = float32
  compute_dtype = float32
  block x 2 {
    attention = gqa(heads = 9, kv_heads = 3, head_dim = 64, rope = rope(theta = 100000))
    mlp = glu(hidden = 1536, act = silu)
    norm = rmsnorm(eps = 1e-5)
  }
}
"""
QWEN_SHAPED = """
model qwen-shaped extends qwen2.5-7b {
  vocab = 512
  d_model = 64
  max_seq = 256
  compute_dtype = float32
  block x 2 {
    attention.heads = 4
    attention.kv_heads = 2
    attention.head_dim = 16
    mlp.hidden = 128
  }
}
"""


def _joined_and_apart(spec, seed):
    """Greedy logits and the decode step's weight products, with the CPU serving conversion's
    projections joined and with them apart."""
    import dataclasses
    import re

    from mxc.compiler.lower.choices import LoweringChoices, use_lowering
    from mxc.runtime.layer_layout import has_joined

    params = init_params(spec, jax.random.key(seed))
    prompt = np.random.default_rng(seed).integers(0, spec.vocab, (1, PROMPT)).astype(np.int32)
    cpu = LoweringChoices.for_platform("cpu")
    results = []
    for choices in (cpu, dataclasses.replace(cpu, joined_serving_projections=False)):
        with use_lowering(choices):
            layered = per_layer_arrays(params)
            logits, cache = _greedy(spec, layered, prompt)
            _, decode = serving_steps(spec, 1, CACHE, dtype="float32")
            text = jax.jit(decode).lower(layered, np.zeros(1, np.int32), cache).as_text()
        results.append((has_joined(layered), logits, len(re.findall(r"stablehlo\.dot_general", text))))
    return results


def test_joined_projections_serve_the_tokens_of_separate_ones():
    """CPU serving joins q/k/v and gate/up into one kernel each (layer_layout.joined_block): three
    weight products a layer fewer, and the greedy tokens and logits of the separate kernels (to
    float32 rounding; bit-identical where measured). Swapping the joined parts fails this test."""
    from mxc.spec.load import load_text

    for spec in (load_model(MODEL), load_text(SMOLLM2_SHAPED)["smollm2-shaped"], load_text(QWEN_SHAPED)["qwen-shaped"]):
        (joined, joined_logits, joined_dots), (apart, apart_logits, apart_dots) = _joined_and_apart(spec, 3)
        assert joined and not apart, spec.name
        assert apart_dots - joined_dots == 3 * spec.layers[0].repeat, (spec.name, apart_dots, joined_dots)
        np.testing.assert_array_equal(np.argmax(joined_logits, -1), np.argmax(apart_logits, -1))
        np.testing.assert_allclose(joined_logits, apart_logits, rtol=1e-5, atol=1e-5, err_msg=spec.name)
