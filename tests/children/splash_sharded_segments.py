"""Splash attention under shard_map (batch and heads split over 4 virtual CPU devices, the kernel
run by Pallas's interpreter) on packed rows with segment ids, sinks and a chunked variant, against
the unsharded XLA path.

    python splash_sharded_segments.py

Needs XLA_FLAGS=--xla_force_host_platform_device_count=4. Prints one JSON object: the largest
difference from the reference per case, and the device count."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.sharding import use_rules
from mxc.compiler.lower.splash import splash_attend

SEQ, HEADS, KV_HEADS, HEAD_DIM, BATCH = 256, 4, 2, 16, 2
DOCUMENTS = (70, 100, 1, 85)


def main() -> None:
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (BATCH, SEQ, HEADS, HEAD_DIM))
    k = jax.random.normal(keys[1], (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(keys[2], (BATCH, SEQ, KV_HEADS, HEAD_DIM))
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(DOCUMENTS)])
    positions = np.concatenate([np.arange(n) for n in DOCUMENTS])
    segment_ids = jnp.asarray(np.stack([segments, segments[::-1]]), jnp.int32)
    positions = jnp.asarray(np.stack([positions, np.concatenate([np.arange(n) for n in DOCUMENTS[::-1]])]), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    rules = {"batch": ["data"], "heads": ["tensor"], "kv_heads": ["tensor"]}
    cases = {"window_sinks": {"window": 40, "sinks": jnp.linspace(-1.0, 2.0, HEADS)}, "chunked": {"chunk": 32}}
    report = {"devices": len(jax.devices())}
    for name, options in cases.items():
        where = dict(q_positions=positions, kv_positions=positions, segment_ids=segment_ids, scale=0.3, **options)
        reference = attend(q, k, v, **where)
        with use_rules(mesh, rules):
            kernel = jax.jit(lambda q, k, v: splash_attend(q, k, v, interpret=True, **where))(q, k, v)
        report[name] = float(jnp.max(jnp.abs(kernel - reference)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
