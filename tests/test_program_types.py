"""The runtime reads every element type a compiled executable can take from its entry layout,
the quantized ones included (int4 and float8 weights of `mxc compile --quantize`), so a quantized
artifact's executables match its manifest."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxc.runtime.program import executable_parameters


def test_quantized_parameter_types_read_as_the_manifest_names_them():
    compiled = jax.jit(lambda a, b, c, d: a.sum() + b.astype(jnp.float32).sum() + c.astype(jnp.float32).sum()
                       + d.astype(jnp.float32).sum()).lower(
        jnp.zeros((2,), jnp.bfloat16), jnp.zeros((3, 4), jnp.int4), jnp.zeros((5,), jnp.float8_e4m3fn),
        jnp.zeros((6,), jnp.float8_e5m2)).compile()
    assert executable_parameters(compiled.runtime_executable()) == [
        ("bfloat16", (2,)), ("int4", (3, 4)), ("float8_e4m3fn", (5,)), ("float8_e5m2", (6,))]
