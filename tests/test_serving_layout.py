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
    layered, _ = per_layer_abstract(shapes, shardings)
    assert jax.tree.structure(layered) == jax.tree.structure(jax.eval_shape(per_layer, shapes))
    back = stacked_abstract(layered)
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
