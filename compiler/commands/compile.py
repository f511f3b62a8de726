"""`mxc compile MODEL --topology T`: plan, lower and compile every function of a model for a
topology, and write the artifact (see mxc.runtime.artifact for its layout).

The planning arguments and their defaults (MaxText's recipe: 4 sequences of min(4096, max_seq)
tokens per chip) are mxc plan's (add_planning_arguments). Progress
goes to stderr stage by stage; the summary (or with --json the summary as JSON) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mxc.compiler.commands import UserError
from mxc.compiler.commands.plan import add_planning_arguments, parse_pins, planning_shapes
from mxc.compiler.commands.units import duration
TRAIN_FUNCTIONS = ("init", "train_step", "eval_step")
SERVE_FUNCTIONS = ("prefill", "decode")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile a model for a topology into an artifact",
        description="Compile init, train step and eval step (with --serve also prefill and decode) "
                    "of MODEL for topology T, and write the artifact directory.")
    add_planning_arguments(parser)
    parser.add_argument("--plan", metavar="PLAN.json", help="a plan to follow (from mxc plan -o) instead of planning")
    parser.add_argument("--learning-rate", type=float, metavar="LR",
                        help="the peak learning rate mxc run defaults to with this artifact (3e-4)")
    parser.add_argument("--warmup-steps", type=int, metavar="N",
                        help="mxc run's default warmup (a tenth of the total; a run takes at most a tenth of its --steps)")
    parser.add_argument("--total-steps", type=int, metavar="N",
                        help="the schedule's length these defaults describe (10000; mxc run decays over its --steps)")
    parser.add_argument("--weight-decay", type=float, metavar="W", help="AdamW weight decay (default 0.1)")
    parser.add_argument("--freeze", action="append", default=[], metavar="GROUP",
                        help="a parameter group the train step leaves as it is (e.g. vision): no gradient, "
                             "no optimizer state; repeatable")
    parser.add_argument("--images-per-row", type=int, metavar="N",
                        help="image slots per batch row for a model with a vision tower (default 1): the "
                             "train and eval steps' and, with --serve, the prefill's")
    parser.add_argument("--serve", action="store_true", help="also compile prefill and decode")
    parser.add_argument("--serve-batch", type=int, metavar="B",
                        help="sequences decoded together (default: one per device of the batch axes)")
    parser.add_argument("--prompt-len", type=int, metavar="P", help="prefill length (default: half the cache)")
    parser.add_argument("--cache-len", type=int, metavar="L", help="KV cache length (default: the seq)")
    parser.add_argument("--quantize", metavar="CONFIG",
                        help="quantization: fp32, bf16, int8, w8a8, int4, int4-mlp, fp8, int8-kv, or a weight "
                             "configuration+int8-kv (default: the spec's quantize field, else none; "
                             "docs/quantization.md)")
    parser.add_argument("--functions", metavar="NAME,...",
                        help="compile only these (of init, train_step, eval_step, prefill, decode)")
    parser.add_argument("-o", "--output", metavar="DIR", help="artifact directory (default: build/MODEL-T)")
    parser.add_argument("--force", action="store_true", help="replace an existing artifact")
    parser.add_argument("--no-cache", action="store_true", help="compile even if the compile cache has it")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--sign", metavar="KEY", help="sign the artifact with this ed25519 private key (PEM): "
                        "runtimes given trusted keys load only signed artifacts (docs/security.md)")
    parser.set_defaults(func=handler, compiles=True)


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise UserError(f"{name} must be a positive number, not {value}")


def _prepare_process(topology) -> None:
    """Environment that must be set before jax is imported (beside what the CLI's
    topology.prepare_jax_platforms sets for every command: cpu-N's device count)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if topology.name != "local":
        # TPU and GPU targets are described, not attached, and cpu-N runs on the host: keep jax
        # from probing for a local TPU (libtpu's start-up noise, its lock file).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def choose_plan(spec, topology, seq: int, batch: int, args):
    """The plan to compile: the file given, else the planner's choice. The planner does not
    compile candidates here: compiling the artifact is XLA's verdict on the plan."""
    from mxc.compiler.plan import Plan, PlanError, plan

    if args.plan is not None:
        if args.pin or args.remat or args.microbatches:
            raise UserError("--plan fixes the mesh, remat and microbatches: drop --pin, --remat and --microbatches")
        try:
            chosen = Plan.load(args.plan)
        except FileNotFoundError:
            raise UserError(f"no such plan file: {args.plan}") from None
        except ValueError as err:
            raise UserError(f"{args.plan} is not a valid plan: {err}") from None
        _check_plan_is_for(chosen, spec, args.plan)
        if chosen.topology != topology.name or chosen.chips != topology.chips:
            raise UserError(f"{args.plan} is a plan for {chosen.topology} ({chosen.chips} chips), not "
                            f"{topology.name} ({topology.chips} chips)")
        if (chosen.seq, chosen.batch) != (seq, batch):
            raise UserError(f"{args.plan} plans sequences of {chosen.seq} in batches of {chosen.batch}, "
                            f"not {seq} and {batch}: drop --seq/--batch or plan again")
        return chosen
    try:
        return plan(spec, topology, seq=seq, batch=batch, pins=parse_pins(args.pin), remat=args.remat,
                    microbatches=args.microbatches, verify=False)
    except PlanError as err:
        raise UserError(str(err)) from None


def _check_plan_is_for(chosen, spec, path: str) -> None:
    """A plan's shardings are sized for the model it was made for; another model's plan would
    compile into an artifact whose manifest names one model and carries another's plan."""
    from mxc.compiler.plan.plan import spec_hash

    if chosen.model != spec.name:
        raise UserError(f"{path} is a plan for {chosen.model}, not {spec.name}: plan {spec.name} with mxc plan")
    if chosen.spec_hash and chosen.spec_hash != spec_hash(spec):
        raise UserError(f"{path} is a plan for another version of {spec.name} (its spec changed since, or "
                        f"other --set values): plan {spec.name} again with mxc plan")


def _batch_divisor(plan, axis: str = "batch") -> int:
    size = 1
    for mesh_axis in plan.rules.get(axis, ()):
        size *= plan.mesh.get(mesh_axis, 1)
    return size


def shapes(args, spec, topology) -> tuple[int, int]:
    """(seq, batch): the flags, a plan file's, or the planning defaults (planning_shapes)."""
    for name in ("serve_batch", "prompt_len", "cache_len"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    return planning_shapes(args, spec, topology, _plan_shapes(args.plan) if args.plan else None)


def _plan_shapes(path: str) -> tuple[int, int] | None:
    try:
        data = json.loads(open(path).read())
        return int(data["seq"]), int(data["batch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # choose_plan reports what is wrong with the file


def run_config(args, spec, plan, seq: int, batch: int):
    from mxc.compiler.aot import RunConfig

    divisor = _batch_divisor(plan) * plan.microbatches
    if batch % divisor:
        raise UserError(f"--batch {batch} does not split over the plan's batch axes and microbatches "
                        f"({divisor} ways); use a multiple of {divisor}")
    cache_len = args.cache_len or seq
    serve_batch = args.serve_batch or _batch_divisor(plan)
    prompt_len = args.prompt_len or max(1, cache_len // 2)
    if args.serve:
        if cache_len > spec.max_seq:
            raise UserError(f"--cache-len {cache_len} exceeds {spec.name}'s max_seq of {spec.max_seq}")
        if prompt_len >= cache_len:
            raise UserError(f"--prompt-len {prompt_len} leaves no room to decode in a cache of {cache_len}")
        if serve_batch % _batch_divisor(plan):
            raise UserError(f"--serve-batch {serve_batch} does not split over the plan's batch axes; use a "
                            f"multiple of {_batch_divisor(plan)}")
    if args.images_per_row is not None and (spec.vision is None or args.images_per_row < 0):
        raise UserError(f"--images-per-row: {spec.name} has no vision tower" if spec.vision is None
                        else "--images-per-row must be 0 or more")
    optimizer = optimizer_config(args)
    if args.freeze:
        from mxc.compiler.lower.train import frozen_groups

        try:
            frozen_groups(spec, tuple(args.freeze))
        except ValueError as err:
            raise UserError(f"--freeze: {err}") from None
        optimizer = optimizer.model_copy(update={"freeze": tuple(args.freeze)})
    return RunConfig(seq=seq, batch=batch, optimizer=optimizer, serve=args.serve,
                     serve_batch=serve_batch, prompt_len=prompt_len, cache_len=cache_len,
                     functions=_functions(args), images_per_row=args.images_per_row)


def optimizer_config(args):
    """The schedule is compiled into the train step, so it is chosen here."""
    from pydantic import ValidationError

    from mxc.compiler.lower.optimizer import OptimizerConfig

    given = {"learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps,
             "total_steps": args.total_steps, "weight_decay": args.weight_decay}
    try:
        return OptimizerConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        problems = "; ".join(f"--{'-'.join(str(e['loc'][0]).split('_')) if e['loc'] else 'optimizer'}: "
                             f"{e['msg']}" for e in err.errors())
        raise UserError(f"bad optimizer setting: {problems}") from None


def _functions(args) -> tuple[str, ...] | None:
    if args.functions is None:
        return None
    known = TRAIN_FUNCTIONS + (SERVE_FUNCTIONS if args.serve else ())
    chosen = tuple(name.strip() for name in args.functions.split(",") if name.strip())
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        hint = "" if args.serve else " (prefill and decode need --serve)"
        raise UserError(f"--functions {args.functions}: choose from {', '.join(known)}{hint}")
    return chosen


class ProgressView:
    """One line per finished stage with its time; a spinner while a stage runs (on a terminal)."""

    def __init__(self, console):
        self.console = console
        self.status = None

    def start(self, label: str) -> None:
        self.status = self.console.status(f"{label} ...")
        self.status.start()

    def end(self, label: str, seconds: float, cpu_seconds: float) -> None:
        if self.status is not None:
            self.status.stop()
        self.console.print(f"  [green]done[/] {label:<32} {duration(seconds):>9}  (cpu {duration(cpu_seconds)})")


def _attached(topology, devices: list):
    """`local`: whatever is attached, so plan for exactly those devices."""
    from mxc.compiler.topology import TopologyError, attached_topology

    try:
        return attached_topology(topology, devices)
    except TopologyError as err:
        raise UserError(str(err)) from None


def _check_signing_key(path: str) -> None:
    from mxc.runtime.signing import SigningError, load_private_key

    try:
        load_private_key(path)
    except SigningError as err:
        raise UserError(f"--sign: {err}") from None


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.topology import TopologyError, parse

    started = time.perf_counter()
    try:
        topology = parse(args.topology, args.slices)
    except TopologyError as err:
        raise UserError(str(err)) from None
    _prepare_process(topology)
    quantization = quantization_name(args.quantize)  # a misspelt name fails before anything is loaded
    if args.sign:  # a bad key must fail before minutes of compiling, not after
        _check_signing_key(args.sign)

    from rich.console import Console

    from mxc.compiler.aot import Stages
    from mxc.compiler.artifact_writer import ArtifactExistsError, check_destination
    from mxc.compiler.commands.refs import load_one

    console = Console(stderr=True)
    view = ProgressView(console)
    stages = Stages(view.start, view.end)
    with stages.stage("load model"):
        spec = load_one(args.model, args.overrides)
    spec = with_quantization(spec, quantization)
    suffix = f"x{topology.slices}" if topology.slices > 1 else ""
    output = args.output or os.path.join("build", f"{spec.name}-{topology.name}{suffix}")
    try:
        check_destination(output, args.force)
    except ArtifactExistsError as err:
        raise UserError(str(err)) from None
    with stages.stage("devices"):
        devices = _devices(topology)
    topology = _attached(topology, devices)
    seq, batch = shapes(args, spec, topology)
    with stages.stage("plan"):
        plan = choose_plan(spec, topology, seq, batch, args)
    run = run_config(args, spec, plan, seq, batch)
    manifest, cached = _compile_or_reuse(spec, topology, devices, plan, run, output, args, stages)
    if args.sign:
        from mxc.runtime.signing import SigningError, sign_artifact

        try:
            sign_artifact(output, args.sign)
        except SigningError as err:
            raise UserError(str(err)) from None

    from mxc.compiler import allocator
    from mxc.compiler.commands.artifact_summary import render, summary_json

    summary = summary_json(manifest, output)
    summary["cached"] = cached
    summary["allocator"] = allocator.current()
    summary["seconds"] = round(time.perf_counter() - started, 3)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        render(summary, Console())
        Console().print(("reused the compile cache's artifact" if cached else "compiled")
                        + f" in {duration(summary['seconds'])}")
    return 0


def quantization_name(name: str | None) -> str | None:
    """--quantize's configuration, by its canonical name."""
    if name is None:
        return None
    from mxc.compiler.quant.config import QuantizationError, parse

    try:
        return parse(name).name
    except QuantizationError as err:
        raise UserError(f"--quantize: {err}") from None


def with_quantization(spec, name: str | None):
    """The spec with --quantize's configuration (recorded in the manifest's spec), else as it is."""
    return spec if name is None else spec.model_copy(update={"quantize": name})


def _devices(topology) -> list:
    from mxc.compiler.aot import target_devices
    from mxc.compiler.topology import TopologyError

    try:
        return target_devices(topology)
    except TopologyError as err:
        raise UserError(str(err)) from None


def _compile_or_reuse(spec, topology, devices, plan, run, output, args, stages):
    """compile_cache.compile_to, with XLA's refusals of a plan turned into messages for the user."""
    from mxc.compiler.artifact_writer import ArtifactExistsError
    from mxc.compiler.compile_cache import compile_to
    from mxc.compiler.lower.params import UnsupportedError

    try:
        return compile_to(output, spec, topology, devices, plan, run, force=args.force,
                          use_cache=not args.no_cache, stages=stages)
    except ArtifactExistsError as err:  # the destination appeared while compiling
        raise UserError(str(err)) from None
    except UnsupportedError as err:
        raise UserError(f"{spec.name} cannot be compiled yet: {err}") from None
    except ValueError as err:  # shapes the plan cannot split, options the lowering refuses
        if os.environ.get("MXC_DEBUG") == "1":
            raise
        raise UserError(f"cannot compile {spec.name} for {topology.name}: {err}") from None
    except Exception as err:
        text = str(err)
        if any(sign in text for sign in ("RESOURCE_EXHAUSTED", "Ran out of memory", "exceeds available HBM")):
            first = text.strip().splitlines()[0]
            raise UserError(f"the plan does not fit {topology.name}'s memory: {first}") from None
        raise
