"""Builds the CLI's parser (what `mxc --help` does) and prints which heavy modules that imported.

    python parser_imports.py

Prints a sorted list of the names among jax, lark, pydantic and rich found in sys.modules."""

import sys

from mxc.compiler import cli


def main() -> None:
    cli.build_parser()
    print(sorted(m for m in ("jax", "lark", "pydantic", "rich") if m in sys.modules))


if __name__ == "__main__":
    main()
