"""`mxc ARGS` with one change: the optimizer the compiled train step uses.

    python compile_with_schedule.py OPTIMIZER_JSON ARGS...

OPTIMIZER_JSON holds OptimizerConfig's fields (the compile command has no optimizer flags yet, and
its default schedule warms up over 1,000 steps, too long for a short test run)."""

import dataclasses
import json
import sys

from mxc.compiler import cli
from mxc.compiler.commands import compile as compile_command
from mxc.compiler.lower.optimizer import OptimizerConfig


def main(argv: list[str]) -> int:
    optimizer = OptimizerConfig(**json.loads(argv[0]))
    planned = compile_command.run_config
    compile_command.run_config = lambda *a, **k: dataclasses.replace(planned(*a, **k), optimizer=optimizer)
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
