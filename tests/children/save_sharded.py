"""Saves checkpoint step 7 with parameters split over every device along one `fsdp` axis.

    python save_sharded.py DIRECTORY

w is arange(64).reshape(16, 4), b is arange(8), the optimizer state {"step": 7}."""

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mxc.runtime.checkpoint import Checkpoints


def main(directory: str) -> None:
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = {"w": put(np.arange(64.0).reshape(16, 4), P("fsdp")), "b": put(np.arange(8.0), P("fsdp"))}
    checkpoints = Checkpoints(directory)
    checkpoints.save(7, params=params, optimizer={"step": put(np.int32(7), P())}, meta={"step": 7})
    checkpoints.close()


if __name__ == "__main__":
    main(sys.argv[1])
