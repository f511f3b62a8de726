"""Restores the checkpoint save_sharded.py wrote onto a (data 2, tensor N/2) mesh of this
process's devices, w split the other way round, and checks every value and placement.

    python restore_elsewhere.py DIRECTORY

Prints "restored on N devices" when everything matches; a mismatch raises."""

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mxc.runtime.checkpoint import Checkpoints


def main(directory: str) -> None:
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(2, -1), ("data", "tensor"))
    target = {"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=NamedSharding(mesh, P("tensor", "data"))),
              "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}
    step = {"step": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))}
    params, optimizer, meta = Checkpoints(directory).restore(7, params_target=target, optimizer_target=step)
    assert params["w"].sharding == target["w"].sharding, params["w"].sharding
    assert len(params["w"].addressable_shards) == len(devices)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.arange(64.0).reshape(16, 4))
    np.testing.assert_array_equal(np.asarray(params["b"]), np.arange(8.0))
    assert int(optimizer["step"]) == 7 and meta == {"step": 7}
    print("restored on", len(devices), "devices")


if __name__ == "__main__":
    main(sys.argv[1])
