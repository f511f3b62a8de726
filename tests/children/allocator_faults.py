"""A process that restarts itself as training does, then runs a program whose 64 MB result comes
back every call (freed before the next), and reports the minor page faults of the last calls.

    python allocator_faults.py

Prints {"allocator", "conf", "faults"} as JSON on its last line."""

import json
import os
import resource

from mxc.runtime.allocator import current, train_on_jemalloc


def main() -> None:
    train_on_jemalloc()
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.ones((4096, 4096), jnp.float32)
    for _ in range(3):
        step(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step(x).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
    print(json.dumps({"allocator": current(), "conf": os.environ.get("MALLOC_CONF"), "faults": faults}))


if __name__ == "__main__":
    main()
