"""`mxc inspect DIR`: an artifact's manifest in brief, after checking its format and file hashes.

`--check` also checks that this host could run it (live devices, library versions) without
deserialising anything: the refusals `mxc.runtime.load` would give, as exit status 1.
"""

from __future__ import annotations

import argparse
import json

from mxc.compiler.commands import UserError


def register(subparsers) -> None:
    from mxc.runtime.cli import add_trust_arguments

    parser = subparsers.add_parser(
        "inspect", help="summarise a compiled artifact",
        description="Print the summary of a compiled artifact (functions, memory per device, FLOPs). "
                    "The format version and every file's size and sha256 are checked first.")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--check", action="store_true",
                        help="also check that this host's devices and libraries can run it")
    add_trust_arguments(parser)
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.runtime.artifact import ArtifactError
    from mxc.runtime.artifact_reader import read_verified

    from mxc.compiler.commands.artifact_summary import render, summary_json

    try:
        manifest = read_verified(args.directory, trusted_keys=args.trusted_key).manifest
        differences = _check_host(manifest) if args.check else None
    except ArtifactError as err:
        raise UserError(str(err)) from None
    summary = summary_json(manifest, args.directory)
    if differences is not None:
        summary["host"] = {"runs_here": True, "recompiles_for": differences}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    render(summary, console)
    if differences:
        console.print(f"this host can run it after recompiling from StableHLO ({', '.join(differences)})")
    elif differences is not None:
        console.print("this host can run it as compiled")
    return 0


def _check_host(manifest) -> list[str]:
    """Version differences that would force a recompile; raises ArtifactError if it cannot run."""
    import sys

    from mxc.compiler.topology import _quiet_stderr, request_host_devices

    # Any CPU host can run a cpu-N artifact once it asks XLA for N virtual devices.
    if manifest.topology.platform == "cpu" and "jax" not in sys.modules:
        request_host_devices(manifest.topology.devices)
    from mxc.runtime.artifact_reader import check_devices, version_differences
    from mxc.runtime.program import live_devices

    with _quiet_stderr():  # libtpu's start-up complaints on a host without TPUs
        found = live_devices(manifest.topology.platform)
    check_devices(manifest.topology, found)
    return version_differences(manifest.versions, manifest.topology.platform)
