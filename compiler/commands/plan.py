"""`mxc plan MODEL --topology T`: the mesh, sharding rules, remat policy and microbatches for
training MODEL on T, checked by compiling the train step for T. The planning arguments (and their
defaults) are shared with `mxc compile`: add_planning_arguments, planning_shapes."""

from __future__ import annotations

import argparse
import json
import sys

from mxc.compiler.commands import UserError


# MaxText's recipe when --seq/--batch are not given: 4 sequences of min(4096, max_seq) per chip.
SEQUENCES_PER_CHIP = 4
DEFAULT_SEQ = 4096


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="choose mesh, sharding, remat and microbatches for a model on a topology",
        description="Search mesh factorisations, remat policies and microbatch counts for training "
                    "MODEL on a topology, rank them by estimated step time among those predicted to "
                    "fit, and compile the best for the real topology: XLA's memory analysis decides.")
    add_planning_arguments(parser)
    parser.add_argument("--attempts", type=int, default=None, metavar="N",
                        help="candidates to compile before giving up (default: 3, and more while none fits "
                             "within 10 minutes of planning)")
    parser.add_argument("--compare", default="auto", metavar="K",
                        help="compile until K candidates fit (within --attempts) and keep the fastest by its "
                             "compiled program's estimate, not the formula's; 'auto' (the default): on TPUs, the first "
                             "that fits and the next within 2%% of its formula step time, within --attempts "
                             "and 10 minutes of planning")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip compiling: the analytic prediction alone decides")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--explain", action="store_true",
                        help="also print why each choice was made and the candidates that lost")
    parser.add_argument("-o", "--output", metavar="PLAN.json", help="save the plan as JSON (for mxc compile --plan)")
    parser.add_argument("--maxtext", action="append", default=[], metavar="KEY=VALUE",
                        help="compile and estimate MaxText's setting as MaxText writes it instead of searching "
                             "(per_device_batch_size, ici_*/dcn_*_parallelism, remat_policy and the custom "
                             "remat names, capacity_factor, megablox, sparse_matmul, "
                             "gradient_accumulation_steps, max_target_length, ...); repeatable")
    parser.set_defaults(func=handler, compiles=True)


class _RematPolicies:
    """The remat policy names for argparse's choices, read from the planner's table only when
    argparse checks a value or prints help: importing the planner would add 0.3 s to every mxc start."""

    @staticmethod
    def _names() -> tuple[str, ...]:
        from mxc.compiler.lower.remat import POLICY_NAMES

        return POLICY_NAMES

    def __contains__(self, name) -> bool:
        from mxc.compiler.lower.remat import saved

        try:  # a custom policy's settings are checked too
            return saved(name) is not None
        except ValueError:
            return False

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


def add_planning_arguments(parser) -> None:
    """What `mxc plan` and `mxc compile` both take to plan a model on a topology, with the same
    defaults (resolved by planning_shapes)."""
    parser.add_argument("model", metavar="MODEL", help="a zoo name, a .mspec file or FILE.mspec:NAME")
    from mxc.compiler.commands.refs import add_set_option
    add_set_option(parser)  # --set PATH=VALUE, as check and show take it
    parser.add_argument("--topology", "-t", required=True, metavar="T",
                        help="v5p-1024, v5e-256, v6e-8, h100-8, h100-8x4, cpu-8, local, ... "
                             "(mxc topologies lists them)")
    parser.add_argument("--slices", type=int, default=1, metavar="K", help="TPU slices joined over DCN")
    parser.add_argument("--seq", type=int, metavar="S", help="tokens per sequence (default: min(4096, max_seq))")
    parser.add_argument("--batch", type=int, metavar="B",
                        help=f"global batch in sequences (default: {SEQUENCES_PER_CHIP} per chip)")
    parser.add_argument("--pin", action="append", default=[], metavar="AXIS=N",
                        help="fix a mesh axis size (data, fsdp, tensor, expert, context); repeatable")
    parser.add_argument("--remat", choices=_RematPolicies(), metavar="POLICY",
                        help="fix the remat policy instead of searching: %(choices)s")
    parser.add_argument("--microbatches", type=int, metavar="N", help="fix the microbatch count")


def planning_shapes(args, spec, topology, planned: tuple[int, int] | None = None) -> tuple[int, int]:
    """(seq, batch): the flags, else `planned` (a plan file's), else MaxText's recipe of
    4 x min(4096, max_seq) per chip. Checks --microbatches against the batch."""
    for flag, value in (("--seq", args.seq), ("--batch", args.batch)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive number, not {value}")
    seq = args.seq or (planned[0] if planned else min(DEFAULT_SEQ, spec.max_seq))
    if seq > spec.max_seq:
        raise UserError(f"--seq {seq} exceeds {spec.name}'s max_seq of {spec.max_seq}")
    batch = args.batch or (planned[1] if planned else SEQUENCES_PER_CHIP * topology.chips)
    if args.microbatches is not None and (args.microbatches < 1 or batch % args.microbatches):
        raise UserError(f"--microbatches {args.microbatches} must divide the batch of {batch}")
    return seq, batch


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


def _maxtext_plan(args, spec, topology, pins, say):
    """The plan for exactly the --maxtext setting: no search."""
    from mxc.compiler.plan.maxtext import MaxTextError, parse_pairs, plan_setting

    fixed = [flag for flag, value in (("--pin", pins), ("--remat", args.remat),
                                      ("--microbatches", args.microbatches)) if value]
    if fixed:
        raise UserError(f"--maxtext fixes the whole setting; {', '.join(fixed)} cannot be combined with it "
                        "(write MaxText's key instead, e.g. --maxtext ici_tensor_parallelism=4)")
    for flag, value in (("--seq", args.seq), ("--batch", args.batch)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive number, not {value}")
    try:
        params = parse_pairs(args.maxtext)
        if not args.no_verify:
            say("compiling the train step for MaxText's setting ...")
        return plan_setting(spec, topology, params, seq=args.seq, batch=args.batch, verify=not args.no_verify)
    except MaxTextError as err:
        raise UserError(str(err)) from None


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.refs import load_one
    from mxc.compiler.plan import PlanError, plan
    from mxc.compiler.topology import TopologyError, attached_topology, devices, parse

    if args.attempts is not None and args.attempts < 1:
        raise UserError(f"--attempts must be a positive number, not {args.attempts}")
    compare = args.compare if args.compare == "auto" else int(args.compare) if args.compare.isdigit() else 0
    if compare == 0:
        raise UserError(f"--compare must be 'auto' or a positive number, not {args.compare}")
    pins = parse_pins(args.pin)
    try:
        topology = parse(args.topology, args.slices)
        if topology.name == "local":  # the host's devices, counted once jax starts
            topology = attached_topology(topology, devices(topology))
    except TopologyError as err:
        raise UserError(str(err)) from None
    spec = load_one(args.model, args.overrides)
    say = (lambda message: print(f"mxc plan: {message}", file=sys.stderr, flush=True))
    if args.maxtext:
        result = _maxtext_plan(args, spec, topology, pins, say)
    else:
        seq, batch = planning_shapes(args, spec, topology)
        try:
            result = plan(spec, topology, seq=seq, batch=batch, pins=pins, remat=args.remat,
                          microbatches=args.microbatches, verify=not args.no_verify, attempts=args.attempts,
                          compare=compare, progress=say)
        except PlanError as err:
            raise UserError(str(err)) from None
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        from mxc.compiler.plan.report import plan_text

        if args.maxtext:
            print("MaxText's setting, as compiled by mxc:")
            print("\n".join(f"  {reason.removeprefix('maxtext: ')}" for reason in result.reasons
                            if reason.startswith("maxtext: ")) + "\n")
        print(plan_text(result, explain=args.explain))
    if not result.fits:
        print(f"mxc plan: {spec.name} does not fit on {topology.name}"
              + (f"; {result.advice[0]}" if result.advice else ""), file=sys.stderr)
        return 1
    return 0
