"""`mxc fmt FILE...`: rewrite .mspec files in canonical form (or, with --check, only say which
would change; with --diff, show how)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from pathlib import Path

from mxc.compiler.commands import UserError, print_error


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "fmt", help="rewrite .mspec files in canonical form",
        description="Rewrite .mspec files in canonical form. A file with a syntax error is "
                    "reported and left untouched.")
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; list the files that would change and exit 1 if any")
    parser.add_argument("--diff", action="store_true",
                        help="rewrite nothing; print a unified diff of what would change and "
                             "exit 1 if any")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.spec.diagnostics import SpecError
    from mxc.spec.format import format_text

    from mxc.compiler.commands.refs import read_source

    changed, failed = [], False
    for path in args.files:
        try:
            text = read_source(path)
            canonical = format_text(text, path)
        except (SpecError, UserError) as err:
            print_error(err)  # and go on: one run reports every file
            failed = True
            continue
        if canonical == text:
            continue
        changed.append(path)
        if args.diff:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(keepends=True), canonical.splitlines(keepends=True),
                fromfile=path, tofile=f"{path} (formatted)"))
        elif args.check:
            print(f"would reformat {path}")
        else:
            _write_atomically(Path(path), canonical)
            print(f"reformatted {path}")
    return 1 if failed or ((args.check or args.diff) and changed) else 0


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it; its permissions are kept."""
    path = path.resolve()  # through a symlink to the file it names
    mode = path.stat().st_mode & 0o7777
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
