"""Reads an artifact's manifest through the runtime's reader alone.

    python read_manifest.py ARTIFACT

Prints the topology's name, the sorted function names, and the sorted compiler, spec, lark and jax
modules the read imported (none expected)."""

import sys

from mxc.runtime.artifact_reader import read_verified


def main(artifact: str) -> None:
    manifest = read_verified(artifact).manifest
    imported = sorted(m for m in sys.modules if m.startswith(("mxc.spec", "mxc.compiler", "lark", "jax")))
    print(manifest.topology.name, sorted(manifest.functions), imported)


if __name__ == "__main__":
    main(sys.argv[1])
