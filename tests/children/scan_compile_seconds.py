"""CPU seconds to compile a model's train step with 8 and with 80 layers.

    python scan_compile_seconds.py MODEL

Prints {"8": seconds, "80": seconds} as JSON: process time, so that other processes on the
machine do not count."""

import json
import sys
import time

import jax
import jax.numpy as jnp

from mxc.compiler.lower.optimizer import OptimizerConfig
from mxc.compiler.lower.train import abstract_train_state, make_train_step
from mxc.spec.ir import Segment
from mxc.spec.load import load_model


def compile_seconds(base, layers: int) -> float:
    block = base.layers[0]
    spec = base.model_copy(update={"layers": (Segment(period=block.period, repeat=layers),)})
    opt = OptimizerConfig()
    state = abstract_train_state(spec, opt)
    batch = {"inputs": jax.ShapeDtypeStruct((2, 32), jnp.int32), "targets": jax.ShapeDtypeStruct((2, 32), jnp.int32),
             "mask": jax.ShapeDtypeStruct((2, 32), jnp.float32)}
    started = time.process_time()
    jax.jit(make_train_step(spec, opt)).lower(state, batch).compile()
    return time.process_time() - started


def main(model: str) -> None:
    base = load_model(model)
    first = compile_seconds(base, 8)  # also pays for XLA's own start: the second 8-layer compile is the fair one
    print(json.dumps({"8": min(first, compile_seconds(base, 8)), "80": compile_seconds(base, 80)}))


if __name__ == "__main__":
    main(sys.argv[1])
