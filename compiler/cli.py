"""The `mxc` command line: one argparse subcommand per module in COMMAND_MODULES.

Every error reaches the user once, without a traceback: diagnostics of a spec as
`file:line:col: error: ...` with the source line (exit 1), a mistake on the command line as
`mxc: error: ...` (exit 1; argparse's own usage errors exit 2), and anything unexpected as
`mxc: internal error: ...` (exit 3). MXC_DEBUG=1 lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mxc import __version__
from mxc.compiler.allocator import compile_on_jemalloc
from mxc.compiler.topology import prepare_jax_platforms
from mxc.compiler.commands import UserError, print_error

# In the order of the workflow, which is the order `mxc --help` lists them in: write and check
# a spec, plan and compile it for a topology, then train, generate, and move checkpoints.
COMMAND_MODULES = [
    "mxc.compiler.commands.check",
    "mxc.compiler.commands.show",
    "mxc.compiler.commands.fmt",
    "mxc.compiler.commands.schema",
    "mxc.compiler.commands.topologies",
    "mxc.compiler.commands.plan",
    "mxc.compiler.commands.compile",
    "mxc.compiler.commands.quantize",
    "mxc.compiler.commands.inspect",
    "mxc.compiler.commands.tokenize",
    "mxc.compiler.commands.run",
    "mxc.compiler.commands.generate",
    "mxc.compiler.commands.forward",
    "mxc.compiler.commands.eval_accuracy",
    "mxc.compiler.commands.import_hf",
    "mxc.compiler.commands.import_gguf",
    "mxc.compiler.commands.export_hf",
    "mxc.compiler.commands.completion",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxc", description="A declarative compiler from model specs to sharded XLA programs.",
        epilog="The commands in the order of the workflow: write and check a spec (check, show, fmt, "
               "schema); plan and compile it for a topology (topologies, plan, compile, inspect); "
               "train and run it (tokenize, run, generate, forward); move checkpoints to and from "
               "HuggingFace (import-hf, export-hf) and import llama.cpp GGUF files (import-gguf). `mxc COMMAND --help` says more.")
    parser.add_argument("--version", action="version", version=f"mxc {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors; returned so tests can call main()
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    # Before any command imports jax (and before a restart on jemalloc, which inherits it).
    prepare_jax_platforms(getattr(args, "topology", None))
    if argv is None and getattr(args, "compiles", False):
        compile_on_jemalloc()  # may start this command again on jemalloc (see mxc.compiler.allocator)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    # Imported here: diagnostics are light, but the rest of mxc.spec (lark, pydantic) is not.
    from mxc.spec.diagnostics import SpecError

    debug = os.environ.get("MXC_DEBUG") == "1"
    try:
        return args.func(args)
    except (SpecError, UserError) as err:
        print_error(err)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`mxc check ... | head`): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as err:
        if debug:
            raise
        print(f"mxc: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        print("mxc: this is a bug in mxc; please report it with the command line and the spec "
              "(MXC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
