"""`mxc plan MODEL --topology T --seq S --batch B`: the mesh, sharding rules, remat policy and
microbatches for training MODEL on T, checked by compiling the train step for T."""

from __future__ import annotations

import argparse
import json
import sys

from mxc.compiler.commands import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="choose mesh, sharding, remat and microbatches for a model on a topology",
        description="Search mesh factorisations, remat policies and microbatch counts for training "
                    "MODEL on a topology, rank them by estimated step time among those predicted to "
                    "fit, and compile the best for the real topology: XLA's memory analysis decides. "
                    "MODEL is a zoo name, a .mspec file or FILE.mspec:NAME.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--topology", required=True, metavar="T",
                        help="v5p-512, v6e-256, v5e-16, h100-8, cpu-8, ... (mxc topologies lists them)")
    parser.add_argument("--seq", type=int, required=True, metavar="S", help="tokens per sequence")
    parser.add_argument("--batch", type=int, required=True, metavar="B", help="global batch, in sequences")
    parser.add_argument("--slices", type=int, default=1, metavar="K", help="TPU slices joined over DCN")
    parser.add_argument("--pin", action="append", default=[], metavar="AXIS=N",
                        help="fix a mesh axis size (data, fsdp, tensor, expert, context); repeatable")
    parser.add_argument("--remat", metavar="POLICY", help="fix the remat policy instead of searching")
    parser.add_argument("--microbatches", type=int, metavar="N", help="fix the microbatch count")
    parser.add_argument("--attempts", type=int, default=3, metavar="N",
                        help="candidates to compile before giving up (default 3)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip compiling: the analytic prediction alone decides")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--explain", action="store_true",
                        help="also print why each choice was made and the candidates that lost")
    parser.add_argument("-o", "--output", metavar="PLAN.json", help="save the plan as JSON (for mxc compile --plan)")
    parser.set_defaults(func=handler, compiles=True)


def parse_pins(pins: list[str]) -> dict[str, int]:
    from mxc.compiler.plan import MESH_AXES

    out = {}
    for pin in pins:
        axis, sep, value = pin.partition("=")
        if not sep or not value.isdigit() or int(value) < 1:
            raise UserError(f"--pin {pin}: write AXIS=N with N a positive number, e.g. --pin tensor=4")
        if axis not in MESH_AXES:
            raise UserError(f"--pin {pin}: unknown mesh axis '{axis}'; the axes are {', '.join(MESH_AXES)}")
        out[axis] = int(value)
    return out


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.refs import load_one
    from mxc.compiler.plan import PlanError, plan
    from mxc.compiler.topology import TopologyError, parse

    for flag, value in (("--seq", args.seq), ("--batch", args.batch), ("--attempts", args.attempts)):
        if value < 1:
            raise UserError(f"{flag} must be positive, not {value}")
    if args.microbatches is not None and (args.microbatches < 1 or args.batch % args.microbatches):
        raise UserError(f"--microbatches {args.microbatches} must divide --batch {args.batch}")
    pins = parse_pins(args.pin)
    if args.remat is not None:
        from mxc.compiler.plan.activations import POLICIES

        if args.remat not in POLICIES:
            raise UserError(f"--remat {args.remat}: unknown policy; choose one of {', '.join(POLICIES)}")
    try:
        topology = parse(args.topology, args.slices)
    except TopologyError as err:
        raise UserError(str(err)) from None
    spec = load_one(args.model)
    say = (lambda message: print(f"mxc plan: {message}", file=sys.stderr, flush=True))
    try:
        result = plan(spec, topology, seq=args.seq, batch=args.batch, pins=pins, remat=args.remat,
                      microbatches=args.microbatches, verify=not args.no_verify, attempts=args.attempts,
                      progress=say)
    except PlanError as err:
        raise UserError(str(err)) from None
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        from mxc.compiler.plan.report import plan_text

        print(plan_text(result, explain=args.explain))
    if not result.fits:
        print(f"mxc plan: {spec.name} does not fit on {topology.name}"
              + (f"; {result.advice[0]}" if result.advice else ""), file=sys.stderr)
        return 1
    return 0
