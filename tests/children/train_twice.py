"""Calls train_step twice with the same state, whose buffers the first call consumed.

    python train_twice.py ARTIFACT

Exits 0 after printing the runtime's error, 5 if the second call ran; a crash of jaxlib shows as
another exit status."""

import sys

import numpy as np

from mxc.runtime.program import load


def main(artifact: str) -> int:
    program = load(artifact)
    batch = {leaf.path[1]: np.zeros(leaf.shape, leaf.dtype)
             for leaf in program.manifest.functions["train_step"].inputs if leaf.path[0] == 1}
    state = program.init(0)
    schedule = {"learning_rate": np.float32(1e-3)}
    program.train_step(state, batch, schedule)
    try:
        program.train_step(state, batch, schedule)  # the same state again: its buffers went to the first call
    except ValueError as err:
        print(err)
        return 0
    return 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
