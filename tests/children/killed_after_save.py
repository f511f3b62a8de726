"""Saves checkpoint steps 1 and 2 synchronously, then kills its own process with SIGKILL, leaving
whatever the saves left on disk.

    python killed_after_save.py DIRECTORY"""

import os
import signal
import sys

import jax.numpy as jnp

from mxc.runtime.checkpoint import Checkpoints


def main(directory: str) -> None:
    checkpoints = Checkpoints(directory, keep=None, async_save=False)
    for step in (1, 2):
        checkpoints.save(step, params={"w": jnp.arange(4.0) * step}, optimizer={"step": jnp.int32(step)},
                         meta={"step": step})
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
