"""`mxc run ARTIFACT ...`: training belongs to the runtime, so this command hands the process over.

The handler replaces the `mxc` process (same process id, so signals still reach it) with
`python -m mxc.runtime run ...`, which never imports the compiler, the spec language or lark:
what trains is exactly what a production host without the compiler would run. The flags are
the runtime's (mxc.runtime.cli); this parser passes every argument through untouched.
"""

from __future__ import annotations

import os
import sys

RUNTIME_MODULE = "mxc.runtime"


def hand_over(command: str, arguments: list[str]) -> int:
    """Replaces this process with the runtime's `command`; returns only if exec fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", RUNTIME_MODULE, command, *arguments])
    return 3  # unreachable: execv either replaces the process or raises OSError


def add_pass_through_parser(subparsers, command: str, help: str) -> None:
    # No prefix characters: `--data x` and `--help` stay plain arguments for the runtime's parser,
    # which owns the flags and the help text.
    parser = subparsers.add_parser(command, help=help, add_help=False, prefix_chars="\0")
    parser.add_argument("arguments", nargs="*")
    parser.set_defaults(func=lambda args: hand_over(command, args.arguments))


def register(subparsers) -> None:
    add_pass_through_parser(subparsers, "run", "train a compiled artifact (resumes from its checkpoints)")


def is_artifact(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))
