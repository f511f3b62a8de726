"""Loads an artifact and runs eval_step once on zeros.

    python load_and_eval.py ARTIFACT

Exits 0 after printing the loader's ArtifactError, 5 if eval_step ran; a crash of jaxlib shows as
another exit status."""

import sys

import numpy as np

from mxc.runtime.artifact import ArtifactError
from mxc.runtime.program import load


def main(artifact: str) -> int:
    try:
        program = load(artifact)
    except ArtifactError as err:
        print(err)
        return 0
    function = program.manifest.functions["eval_step"]
    params = program.init(0)["params"]
    batch = {leaf.path[1]: np.zeros(leaf.shape, leaf.dtype) for leaf in function.inputs if leaf.path[0] == 1}
    program.eval_step(params, batch)
    return 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
