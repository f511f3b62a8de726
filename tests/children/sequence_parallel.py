"""Child of tests/test_memory_levers.py: llama3-tiny on 8 virtual CPU devices (fsdp 4 x tensor 2),
its loss and gradients with the residual stream's sequence split over tensor (sequence
parallelism) against the default rules and against one device, and the collectives each
compiled program has. Prints one JSON object."""

import json
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from mxc.compiler.lower.model import decoder_hidden, forward  # noqa: E402
from mxc.compiler.lower.params import init_params, param_axes  # noqa: E402
from mxc.compiler.lower.sharding import named_sharding, tree_shardings, use_rules  # noqa: E402
from mxc.compiler.plan.layout import parameters  # noqa: E402
from mxc.compiler.plan.rules import SEQUENCE_PARALLEL, make_rules  # noqa: E402
from mxc.spec.load import load_model  # noqa: E402

MESH = {"fsdp": 4, "tensor": 2}


def main() -> dict:
    assert jax.device_count() == 8, jax.devices()
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32"})
    mesh = Mesh(np.array(jax.devices()).reshape(MESH["fsdp"], MESH["tensor"]), tuple(MESH))
    rules, _ = make_rules({**MESH, "data": 1, "context": 1, "expert": 1}, parameters(spec).tensors)
    layouts = {"default": rules, "sequence_parallel": {**rules, "residual_seq": SEQUENCE_PARALLEL}}
    params = init_params(spec, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, spec.vocab)

    def loss(p, t):
        logits = forward(spec, p, t, remat_policy=jax.checkpoint_policies.nothing_saveable)[0]
        picked = jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    reference = jax.jit(jax.value_and_grad(loss))(params, tokens)
    report = {}
    for name, layout in layouts.items():
        placed = jax.device_put(params, tree_shardings(param_axes(spec), mesh, layout))
        with use_rules(mesh, layout):
            step = jax.jit(jax.value_and_grad(loss))
            compiled = step.lower(placed, jax.device_put(tokens, named_sharding(("batch", "seq"), mesh, layout)))
            text = compiled.compile().as_text()
            value, grads = step(placed, tokens)
            hidden = jax.jit(lambda p, t: decoder_hidden(spec, p, t)[0])(placed, tokens)
        report[name] = {
            "loss_diff": abs(float(value - reference[0])),
            "grad_diff": max(float(jnp.abs(a - b).max()) for a, b in
                             zip(jax.tree.leaves(grads), jax.tree.leaves(reference[1]))),
            "grad_scale": max(float(jnp.abs(b).max()) for b in jax.tree.leaves(reference[1])),
            "hidden_spec": [entry if entry is None or isinstance(entry, str) else list(entry)
                            for entry in hidden.sharding.spec],
            "hidden_shard": list(hidden.addressable_shards[0].data.shape),
            "collectives": {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))
                            for op in ("all-gather", "reduce-scatter", "all-reduce")},
        }
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
