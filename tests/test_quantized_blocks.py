"""CPU targets convert a large stored weight (int8, int4, fp8, bf16) and multiply it in cache-sized
blocks of its output axis (compiler/quant/matmul.py's in_blocks): the same products as the whole
conversion, without a converted copy of the whole weight in the compiled program."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower.choices import lowering_choices, use_lowering
from mxc.compiler.lower.projection import project
from mxc.compiler.quant import matmul
from mxc.compiler.quant.config import parse
from mxc.runtime import quant_arrays

# (einsum pattern, activation shape, kernel shape, contracting axes of the kernel): the tied head,
# a query projection and attention's output projection as the lowering writes them.
PRODUCTS = [
    ("bse,ve->bsv", (1, 3, 64), (512, 64), (1,)),
    ("bse,ehd->bshd", (1, 3, 64), (64, 8, 16), (0,)),
    ("bshd,hde->bse", (1, 3, 8, 16), (8, 16, 64), (0, 1)),
]


def _choices(blocked: bool):
    return use_lowering(dataclasses.replace(lowering_choices(), blocked_weight_conversion=blocked))


def _params(kind: str, kernel: jax.Array, contracting) -> dict:
    if kind == "bf16":
        return {"kernel": kernel.astype(jnp.bfloat16)}
    group = 16 if kind == "int4" else None
    values, scale = quant_arrays.quantize(kernel, kind, quant_arrays.scale_shape(kernel.shape, contracting, group))
    return {"kernel": values, "kernel_scale": scale}


CASES = ([(name, *product) for name in ("int8", "int4") for product in PRODUCTS]
         + [(name, *PRODUCTS[0]) for name in ("w8a8", "fp8", "bf16")])


@pytest.mark.parametrize("name,pattern,x_shape,w_shape,contracting", CASES)
def test_blocked_product_equals_the_whole_conversion(monkeypatch, name, pattern, x_shape, w_shape, contracting):
    monkeypatch.setattr(matmul, "BLOCKED_ABOVE", 0)  # every weight here is small
    monkeypatch.setattr(matmul, "BLOCK_BYTES", 4 * 64 * 2)  # blocks of a few output entries
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
    kernel = jax.random.normal(jax.random.key(1), w_shape, jnp.float32)
    params = _params(parse(name).weights, kernel, contracting)
    config = dataclasses.replace(lowering_choices(), quantization=name)
    results = {}
    for blocked in (False, True):
        with use_lowering(dataclasses.replace(config, blocked_weight_conversion=blocked)):
            results[blocked] = np.asarray(jax.jit(lambda x, p: project(x, p, pattern, jnp.float32))(x, params))
    np.testing.assert_allclose(results[True], results[False], rtol=1e-5, atol=1e-5)
    assert np.abs(results[True]).max() > 0


def test_the_compiled_head_holds_no_converted_copy_of_the_table():
    """SmolLM2's tied head shape: converted whole, XLA:CPU writes a 113 MB float32 temporary."""
    vocab, d_model = 49152, 576
    values = jax.ShapeDtypeStruct((vocab, d_model), jnp.int8)
    scale = jax.ShapeDtypeStruct((vocab, 1), jnp.float32)
    x = jax.ShapeDtypeStruct((1, 1, d_model), jnp.float32)
    temps = {}
    for blocked in (False, True):
        with _choices(blocked):
            head = jax.jit(lambda x, v, s: matmul.stored_einsum("bse,ve->bsv", x, v, s, parse("int8"), jnp.float32))
            temps[blocked] = head.lower(x, values, scale).compile().memory_analysis().temp_size_in_bytes
    table_as_float = vocab * d_model * 4
    assert temps[False] >= table_as_float
    assert temps[True] < table_as_float // 8
