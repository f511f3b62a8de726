"""Saves checkpoint step 1, then hangs in step 2's save after everything is written and before
the rename that commits it, so the test can kill the process there.

    python crash_during_save.py DIRECTORY MARKER

Creates the file MARKER when step 2 has reached that point."""

import asyncio
import sys

import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity

from mxc.runtime.checkpoint import Checkpoints


def main(directory: str, marker: str) -> None:
    checkpoints = Checkpoints(directory)
    checkpoints.save(1, params={"w": jnp.arange(4.0)}, optimizer={"step": jnp.int32(1)}, meta={"step": 1})
    checkpoints.wait()

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_then_hang(self):
        # Everything of step 2 is written; the process dies before the rename that commits it.
        if self._final_path.name == "2":
            open(marker, "w").close()
            await asyncio.sleep(3600)
        await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_then_hang
    checkpoints.save(2, params={"w": jnp.arange(4.0) * 100}, optimizer={"step": jnp.int32(2)}, meta={"step": 2})
    checkpoints.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
