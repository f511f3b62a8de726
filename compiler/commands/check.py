"""`mxc check REF...`: load and validate specs, and summarise each model (parameters, layer
pattern, layer kinds, training FLOPs)."""

from __future__ import annotations

import argparse
import json

from mxc.compiler.commands import UserError, print_error, units
from mxc.compiler.commands.refs import add_set_option


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="validate specs and summarise their models",
        description="Validate specs and summarise each model. REF is a zoo model name "
                    "(llama3.1-8b), a .mspec file (all its models) or FILE.mspec:NAME.")
    parser.add_argument("refs", nargs="*", metavar="REF")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON (a list when there are several models); "
                             "if any REF fails: {\"models\": [...], \"diagnostics\": [...]}, each "
                             "diagnostic with file, line, column, end_line, end_column, severity, "
                             "message, hint")
    parser.add_argument("--seq", type=int, metavar="S",
                        help="sequence length for the FLOP count (default: min(max_seq, 4096))")
    parser.add_argument("--list", action="store_true", help="list the zoo's models")
    add_set_option(parser)
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.spec.diagnostics import SpecError

    from mxc.compiler.commands.refs import load_ref

    if args.seq is not None and args.seq <= 0:
        raise UserError(f"--seq must be a positive number of tokens, not {args.seq}")
    if not args.refs and not args.list:
        raise UserError("nothing to check: give a REF (a zoo name, a .mspec file or "
                        "FILE.mspec:NAME), or --list")
    if args.list:
        if args.refs:  # two listings in one output would not parse as one JSON document
            raise UserError("--list takes no REF; check the models in a second run")
        _print_zoo(args.json)
        return 0
    specs, failures = [], []
    for ref in args.refs:
        try:
            specs.extend(load_ref(ref, args.overrides).values())
        except (SpecError, UserError) as err:
            failures.append(err)  # every REF is checked, so one run reports every problem
    if args.seq is not None:
        for spec in specs:
            if args.seq > spec.max_seq:
                failures.append(UserError(f"--seq {args.seq} is longer than {spec.name}'s max_seq "
                                          f"({spec.max_seq})"))
        specs = [spec for spec in specs if args.seq <= spec.max_seq]
    if args.json and failures:
        _print_json_failures(specs, args.seq, failures)
    elif specs:
        _print_summaries(specs, args.seq, args.json)
    for err in failures:
        print_error(err)
    return 1 if failures else 0


def _print_json_failures(specs: list, seq: int | None, failures: list) -> None:
    """One JSON document on stdout even when some REF fails, so editors and CI can read it."""
    from mxc.compiler.analysis import summarize

    diagnostics = []
    for err in failures:
        if isinstance(err, UserError):  # no place in a file: the REF (or option) it is about
            diagnostics.append({"file": None, "line": None, "column": None, "end_line": None,
                                "end_column": None, "severity": "error", "message": str(err),
                                "hint": None})
        else:
            diagnostics.extend(d.to_json() for d in err.diagnostics)
    print(json.dumps({"models": [summarize(spec, seq).to_json() for spec in specs],
                      "diagnostics": diagnostics}, indent=2))


def _print_summaries(specs: list, seq: int | None, as_json: bool) -> None:
    from mxc.compiler.analysis import summarize

    summaries = [summarize(spec, seq) for spec in specs]
    if as_json:
        objects = [s.to_json() for s in summaries]
        print(json.dumps(objects[0] if len(objects) == 1 else objects, indent=2))
        return
    console = _console()
    for spec, summary in zip(specs, summaries):
        console.print(_summary_panel(spec, summary))


def _print_zoo(as_json: bool) -> None:
    from mxc.compiler.analysis import summarize
    from mxc.spec.load import load_model, zoo_names

    rows = []
    for name in zoo_names():
        summary = summarize(load_model(name))
        rows.append({"name": name, "total_params": summary.total_params,
                     "active_params": summary.active_params, "num_layers": summary.num_layers})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="the zoo", title_justify="left")
    table.add_column("model")
    table.add_column("params", justify="right")
    table.add_column("active", justify="right")
    table.add_column("layers", justify="right")
    table.add_column("exact params", justify="right")
    for row in rows:
        table.add_row(row["name"], units.count(row["total_params"]), units.count(row["active_params"]),
                      str(row["num_layers"]), f"{row['total_params']:,}")
    _console().print(table)


def _console():
    from rich.console import Console

    # No syntax highlighting: numbers in random colours read as emphasis.
    return Console(highlight=False)


def pattern_text(layer_pattern: list[dict]) -> str:
    """The layer pattern as people write it: `(local x5, global) x4, local x2`."""
    parts = []
    for segment in layer_pattern:
        runs: list[list] = []
        for name in segment["period"]:
            if runs and runs[-1][0] == name:
                runs[-1][1] += 1
            else:
                runs.append([name, 1])
        if len(runs) == 1:
            name, times = runs[0][0], runs[0][1] * segment["repeat"]
            parts.append(f"{name} x{times}" if times > 1 else name)
            continue
        inner = ", ".join(f"{name} x{times}" if times > 1 else name for name, times in runs)
        parts.append(f"({inner}) x{segment['repeat']}" if segment["repeat"] > 1 else inner)
    return ", ".join(parts)


def _params(value: int) -> str:
    return f"{units.count(value)} ({value:,})"


def _number(value: float) -> str:
    """500000.0 as 500000 (not 5e+05), 0.125 as 0.125."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _rope_text(rope) -> str:
    if rope is None:
        return "none"
    text = f"theta {_number(rope.theta)}"
    if rope.scaling is not None:
        text += f", {rope.scaling.kind} x{_number(rope.scaling.factor)}"
    return text


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def _summary_panel(spec, summary):
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("parameters", _params(summary.total_params))
    facts.add_row("active", _params(summary.active_params))
    if summary.mtp_params:
        facts.add_row("MTP params", _params(summary.mtp_params) + " (training only)")
    tied = "tied with the output head" if spec.embedding.tied else "untied"
    scale = ", scaled by sqrt(d_model)" if spec.embedding.scale == "sqrt_d_model" else ""
    facts.add_row("embedding", f"{_params(summary.embedding_params)}, {tied}{scale}")
    facts.add_row("shape", f"d_model {spec.d_model}, vocab {spec.vocab}, max_seq {spec.max_seq}")
    facts.add_row("layers", f"{summary.num_layers}: {pattern_text(summary.layer_pattern)}")
    facts.add_row("dtypes", f"params {spec.param_dtype}, compute {spec.compute_dtype}")
    facts.add_row("train FLOPs", f"{units.flops(summary.train_flops_per_token)} per token "
                                 f"({summary.train_flops_per_token:.4g}) at seq {summary.flops_seq}")

    kinds = Table(box=None, padding=(0, 2), show_edge=False)
    kinds.add_column("block kind", style="bold")
    for name in summary.layer_kinds:
        kinds.add_column(name, justify="right")
    rows = {"layers": [], "attention": [], "heads": [], "kv_heads": [], "window": [], "chunk": [],
            "rope": [], "ffn": [], "experts": [], "top_k": [], "params/layer": []}
    for name, kind in summary.layer_kinds.items():
        for key in ("layers", "attention", "heads", "kv_heads", "window", "chunk", "ffn", "experts",
                    "top_k"):
            rows[key].append(_or_dash(kind[key]))
        rows["rope"].append(_rope_text(spec.blocks[name].attention.rope))
        rows["params/layer"].append(units.count(kind["params"]))
    if any(kind["active_params"] != kind["params"] for kind in summary.layer_kinds.values()):
        rows["active/layer"] = [units.count(kind["active_params"])
                                for kind in summary.layer_kinds.values()]
    for label, values in rows.items():
        kinds.add_row(label, *values)
    return Panel(Group(facts, "", kinds), title=f"[bold]{spec.name}[/bold]", title_align="left",
                 expand=False)
