"""`mxc topologies`: the topology names mxc knows and the facts of their chips."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "topologies", help="list known topology names and their chip facts",
        description="List the topology names mxc plans and compiles for (every power of two of a "
                    "generation is accepted, these are examples) and the facts of each chip.")
    parser.add_argument("--json", action="store_true", help="print chips and topologies as JSON")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.units import size_in
    from mxc.compiler.topology import CHIPS, XLA_USABLE_HBM, known_names, parse

    topologies = [parse(name) for name in known_names()]
    if args.json:
        print(json.dumps({"chips": {name: {**chip.to_json(), "xla_usable_hbm_bytes": XLA_USABLE_HBM.get(name)}
                                    for name, chip in CHIPS.items()},
                          "topologies": [t.to_json() for t in topologies]}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    chips = Table(title="chips: bf16 TFLOP/s; HBM in GiB (usable: what XLA lets a program use); "
                        "bandwidths in GB/s per chip (ICI: all links, both ways)", title_justify="left")
    for column in ("chip", "TFLOP/s", "HBM", "usable", "HBM BW", "ICI", "links", "DCN", "per host"):
        chips.add_column(column, justify="left" if column == "chip" else "right", no_wrap=True)
    for chip in CHIPS.values():
        usable = XLA_USABLE_HBM.get(chip.name)
        chips.add_row(chip.name, f"{chip.peak_bf16_flops / 1e12:g}", size_in(chip.hbm_bytes),
                      "-" if usable is None else size_in(usable), f"{chip.hbm_bandwidth / 1e9:g}",
                      f"{chip.ici_bandwidth / 1e9:g}", str(chip.ici_links), f"{chip.dcn_bandwidth / 1e9:.3g}",
                      str(chip.chips_per_host))
    console.print(chips)
    names = Table(title="topologies (examples): v4-N and v5p-N count TensorCores, v5e-N and v6e-N chips; "
                        "--slices K joins K TPU slices (v5e-N and v6e-N past 256 chips are N/256 slices of 256)",
                  title_justify="left")
    for column in ("name", "chips", "chip", "shape", "hosts", "libtpu name"):
        names.add_column(column, justify="right" if column in ("chips", "hosts") else "left")
    for topology in topologies:
        shape = "x".join(str(s) for s in topology.shape) if topology.shape else "-"
        chips_text = str(topology.chips) if topology.chips else "attached"
        names.add_row(topology.name, chips_text, topology.chip.name, shape, str(topology.hosts),
                      topology.libtpu_name or "-")
    console.print(names)
    return 0
