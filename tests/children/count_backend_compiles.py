"""`mxc ARGS`, counting the XLA backend compiles it runs.

    python count_backend_compiles.py ARGS...

Prints {"code": exit status of the command, "backend_compiles": N} as JSON on its last line."""

import json
import sys

import jax.monitoring

from mxc.compiler import cli

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def main(argv: list[str]) -> None:
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(event) if event == BACKEND_COMPILE else None)
    code = cli.main(argv)
    print(json.dumps({"code": code, "backend_compiles": len(compiles)}))


if __name__ == "__main__":
    main(sys.argv[1:])
