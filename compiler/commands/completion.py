"""`mxc completion bash|zsh|fish`: a shell completion script generated from mxc's own parser.

shtab writes the script from the argparse parser, so every subcommand and flag completes as
`mxc --help` shows it. Where a model is expected (MODEL, REF) the zoo's model names complete,
beside files (a .mspec file or FILE.mspec:NAME is accepted there too); the names are written
into the script, so completing never starts Python.
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "fish")
MODEL_METAVARS = ("MODEL", "REF")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "completion", help="print a shell completion script (bash, zsh or fish)",
        description="Print a completion script for SHELL; zoo model names complete where a model "
                    "is expected. Install it with e.g. `mxc completion bash > "
                    "~/.local/share/bash-completion/completions/mxc`, `mxc completion zsh > "
                    "\"${fpath[1]}/_mxc\"` or `mxc completion fish > "
                    "~/.config/fish/completions/mxc.fish`.")
    parser.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    import shtab

    from mxc.compiler.cli import build_parser
    from mxc.spec import zoo_names

    parser = build_parser()
    model = model_completion(zoo_names())
    for action in model_arguments(parser):
        action.complete = model
    print(shtab.complete(parser, shell=args.shell), end="")
    return 0


def model_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The positional arguments of every subcommand that name a model."""
    found = []
    for sub in parser._subparsers._group_actions if parser._subparsers else ():
        for command in sub.choices.values():
            found += [a for a in command._actions if a.metavar in MODEL_METAVARS]
    return found


def model_completion(names: list[str]) -> dict:
    """shtab's per-shell completer: the zoo names, then files."""
    words = " ".join(names)
    return {
        "bash": "_mxc_compgen_models",
        "zsh": "_mxc_models",
        "fish": f"(printf '%s\\n' {words}; __fish_complete_path (commandline -ct))",
        "preamble": {
            "bash": f'_mxc_compgen_models() {{\n  compgen -W "{words}" -- "$1"\n  compgen -f -- "$1"\n}}\n',
            "zsh": f"_mxc_models() {{\n  _alternative 'models:zoo model:({words})' 'files:spec file:_files'\n}}\n",
        },
    }
