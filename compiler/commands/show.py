"""`mxc show REF`: the fully resolved IR of one model, every default filled in."""

from __future__ import annotations

import argparse
import json

from mxc.compiler.commands.refs import add_set_option


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "show", help="print the fully resolved IR of a model",
        description="Print the fully resolved IR of one model: `extends` applied, defaults filled "
                    "in. REF is a zoo model name, a .mspec file with one model, or FILE.mspec:NAME.")
    parser.add_argument("ref", metavar="REF")
    parser.add_argument("--json", action="store_true", help="print it as JSON (the IR's JSON form)")
    add_set_option(parser)
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.refs import load_one

    tree = load_one(args.ref, args.overrides).model_dump(mode="json")
    print(json.dumps(tree, indent=2) if args.json else "\n".join(render(tree)))
    return 0


def render(tree: dict, indent: int = 0) -> list[str]:
    """An indented `key: value` rendering; a kind reads as `attention: gqa` with its fields below."""
    pad = "  " * indent
    lines = []
    for key, value in tree.items():
        if key == "kind" and indent > 0:
            continue  # already shown after the parent's key
        if isinstance(value, dict) and value:
            head = f" {value['kind']}" if "kind" in value else ""
            lines.append(f"{pad}{key}:{head}")
            lines.extend(render(value, indent + 1))
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            lines.append(f"{pad}{key}:")
            for item in value:
                item_lines = render(item, indent + 2)
                # The first field of each item carries the list dash.
                lines.append(f"{pad}  - {item_lines[0].lstrip()}")
                lines.extend(item_lines[1:])
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def _scalar(value) -> str:
    """A value as .mspec spells it: true/false/none, lists in brackets."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}"
    return str(value)
