"""The runtime's commands, `python -m mxc.runtime run | generate | tokenize`, which `mxc run`,
`mxc generate ARTIFACT` and `mxc tokenize` hand over to.

They live here, not in the compiler's CLI, so that a training or serving process never imports
the compiler, the spec language or lark: a production host needs only the runtime and the
artifact. Errors print once as `mxc: error: ...` (exit 1); anything unexpected as
`mxc: internal error: ...` (exit 3; MXC_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class CommandError(Exception):
    """A mistake the user can fix; printed as `mxc: error: <message>`."""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several processes (default: JAX_COORDINATOR_ADDRESS and cluster detection)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    group.add_argument("--num-processes", type=positive, metavar="N")
    group.add_argument("--process-id", type=int, metavar="I")
    group.add_argument("--heartbeat-timeout", type=positive, default=100, metavar="SECONDS",
                       help="declare a process dead after this long without a heartbeat (100)")


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trusted-key", action="append", metavar="FILE",
                        help="load the artifact only if one of these ed25519 public keys (PEM; repeatable) "
                             "signed it (default: the keys $MXC_TRUSTED_KEYS names, else no signature needed)")


def add_run_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="train a compiled artifact on the live devices",
        description="Train with a compiled artifact, resuming from the newest checkpoint in --ckpt-dir when "
                    "there is one. Metrics go to --metrics as JSON lines.")
    parser.add_argument("artifact", metavar="ARTIFACT", help="a directory written by `mxc compile`")
    parser.add_argument("--data", required=True, metavar="TOKENS", help="token file (.bin from mxc tokenize, or .npy)")
    parser.add_argument("--steps", required=True, type=positive, metavar="N", help="train until step N")
    parser.add_argument("--ckpt-dir", required=True, metavar="DIR", help="checkpoints: resumed from, written to")
    parser.add_argument("--save-every", type=positive, metavar="K", help="save every K steps (default: at the end)")
    parser.add_argument("--keep", type=positive, default=3, metavar="M", help="keep the newest M checkpoints (3)")
    parser.add_argument("--metrics", metavar="FILE.jsonl", help="write metrics here, one JSON object per line")
    parser.add_argument("--eval-data", metavar="TOKENS", help="token file to evaluate on")
    parser.add_argument("--eval-every", type=positive, metavar="K", help="evaluate every K steps (and at the end)")
    parser.add_argument("--eval-batches", type=positive, default=4, metavar="B", help="batches per evaluation (4)")
    parser.add_argument("--init-from", metavar="CKPT", help="start from these parameters (ignored when resuming)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="initialisation and data order (0)")
    parser.add_argument("--eod-id", type=int, metavar="ID",
                        help="end-of-document id of a .npy token file (a .bin file names its own)")
    parser.add_argument("--in-flight", type=positive, default=2, metavar="N",
                        help="train steps queued on the devices at most (2)")
    parser.add_argument("--log-every", type=positive, default=10, metavar="K",
                        help="without a terminal, print a line every K steps (10)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--no-doc-mask", action="store_true",
                        help="let attention cross document boundaries (default: each document alone)")
    parser.add_argument("--fallback", action="store_true",
                        help="when the newest checkpoint is corrupt or unreadable, resume from the newest intact "
                             "one (without it the run stops and names the step)")
    add_schedule_arguments(parser)
    add_observability_arguments(parser)
    add_trust_arguments(parser)
    add_distributed_arguments(parser)
    parser.set_defaults(func=run_command)


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    from mxc.runtime.schedule import DEFAULT_DECAY_FRACTION, KINDS

    group = parser.add_argument_group(
        "learning-rate schedule (computed every step; a resumed run continues its checkpoint's schedule, "
        "changed only by the flags given)")
    group.add_argument("--learning-rate", type=float, metavar="LR",
                       help="the peak rate (default: the one the artifact was compiled with)")
    group.add_argument("--schedule", choices=KINDS, help="after the warmup: cosine (default) or linear decay to "
                                                         "the floor, constant, or wsd (warmup-stable-decay)")
    group.add_argument("--warmup-steps", type=int, metavar="W",
                       help="linear warmup from 0 (default: the artifact's warmup, at most a tenth of --steps)")
    group.add_argument("--decay-steps", type=int, metavar="D",
                       help="the step at which the rate reaches its floor, warmup included (default: --steps)")
    group.add_argument("--decay-fraction", type=float, metavar="F",
                       help=f"wsd: the last fraction of --decay-steps that decays ({DEFAULT_DECAY_FRACTION})")
    group.add_argument("--min-lr-ratio", type=float, metavar="R",
                       help="the floor as a fraction of the peak (default: the artifact's, 0.1 unless compiled "
                            "otherwise)")


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TensorBoard and profiles")
    group.add_argument("--tensorboard", metavar="DIR", help="write every metric as TensorBoard scalars here")
    group.add_argument("--profile-steps", metavar="K:N",
                       help="trace steps K to N with the JAX profiler (open with xprof or TensorBoard)")
    group.add_argument("--profile-dir", metavar="DIR",
                       help="where --profile-steps writes its trace (default: the --tensorboard DIR)")


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of generation, defined once: `python -m mxc.runtime generate` and `mxc generate`
    (with a spec or an artifact) take exactly these."""
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-tokens", metavar="PROMPT.npy",
                        help="int ids in a .npy of shape (requests, prompt); -1 ids end a shorter row")
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="a text prompt: tokenized with the model's tokenizer, the new text streamed to "
                             "stdout until the end-of-sequence token or --max-new")
    parser.add_argument("--chat", action="store_true",
                        help="with --prompt: apply the tokenizer's chat template to it as a user message")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="with --prompt: the directory of tokenizer.json and tokenizer_config.json (default: "
                             "the model directory's own; an artifact needs it)")
    parser.add_argument("--max-new", required=True, type=positive, metavar="N", help="new tokens per request")
    parser.add_argument("--greedy", action="store_true", help="take the most likely token (the default)")
    parser.add_argument("--temperature", type=float, metavar="T", help="sample at temperature T")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, metavar="P", help="sample within probability mass P")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed for sampling (default 0)")
    parser.add_argument("-o", "--output", metavar="TOKENS.npy",
                        help="write prompt plus new tokens here (required with --prompt-tokens)")
    parser.add_argument("--report", metavar="FILE.json", help="also write the timings here (an artifact only)")


def add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate tokens with a compiled artifact's prefill and decode",
        description="Decode N new tokens after each prompt row with the artifact's precompiled prefill and "
                    "decode (compile with --serve). Greedy unless --temperature, --top-k or --top-p asks "
                    "for sampling.")
    parser.add_argument("artifact", metavar="ARTIFACT")
    parser.add_argument("--params", required=True, metavar="CKPT",
                        help="a --ckpt-dir of mxc run (its newest step), one step of it, or saved parameters")
    parser.add_argument("--images", metavar="INPUTS.npz",
                        help="a vision model's artifact: image inputs as the HF processor makes them, placed in "
                             "the prefill's image slots (runtime/serving_images.py)")
    add_generation_arguments(parser)
    add_trust_arguments(parser)
    add_distributed_arguments(parser)
    parser.set_defaults(func=generate_command)


def add_tokenize_parser(subparsers) -> None:
    from mxc.runtime.tokenize import SPLITS

    parser = subparsers.add_parser(
        "tokenize", help="turn text into a token file for mxc run",
        description="Tokenize text files (.jsonl: one document per line) into an mxc token file. Without "
                    "--tokenizer, bytes: ids 0-255 and 256 for the end of a document.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("-o", "--output", required=True, metavar="TOKENS.bin")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (HF tokenizers), a directory holding one "
                                                            "(e.g. a model of mxc import-gguf) or tokenizer.model "
                                                            "(sentencepiece)")
    parser.add_argument("--eod-token", metavar="TOKEN", help="the tokenizer's end-of-document token")
    parser.add_argument("--split", choices=SPLITS, default="file",
                        help="what one document is in a text file (default: the whole file)")
    parser.add_argument("--text-key", default="text", metavar="KEY", help="the text field of .jsonl records")
    parser.add_argument("--model", metavar="MODEL",
                        help="a vision model (model directory, zoo name or .mspec): the images of .jsonl records "
                             "preprocessed for its tower into TOKENS.bin.images/ (docs/runtime.md); a model "
                             "directory's tokenizer is the default --tokenizer")
    parser.add_argument("--images-key", default="images", metavar="KEY",
                        help="with --model: the field of .jsonl records listing image files")
    parser.set_defaults(func=tokenize_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxc", description="The mxc runtime: train and serve compiled artifacts.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_run_parser(subparsers)
    add_generate_parser(subparsers)
    add_tokenize_parser(subparsers)
    return parser


# ------------------------------------------------------------------ handlers

def prepare_cpu_devices(artifact: str, processes: int) -> None:
    """An artifact for `cpu-N` runs on N virtual CPU devices, split evenly over the processes;
    XLA reads the count from XLA_FLAGS when jax starts, so it is set before jax is imported (a
    count the user set is left alone), and jax is kept from probing for accelerators."""
    from mxc.runtime.artifact_reader import read_manifest

    topology = read_manifest(artifact).topology
    if topology.platform != "cpu" or topology.name == "local" or "jax" in sys.modules:
        return
    from mxc.runtime.cpu_devices import request_cpu_devices

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and topology.devices % processes:
        raise CommandError(f"{topology.devices} devices do not split over {processes} processes")
    request_cpu_devices(topology.devices // processes)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _trusted_keys(args) -> list[str]:
    from mxc.runtime.signing import trusted_keys_from_env

    return args.trusted_key or trusted_keys_from_env()


def _check_signer(args) -> None:
    """With trusted keys, the artifact's signature is checked before anything else of it is read."""
    from mxc.runtime.artifact_reader import check_signer

    keys = _trusted_keys(args)
    if keys:
        check_signer(args.artifact, keys)


def _start_processes(args):
    """Joins the multi-process job, if any; before anything touches a device."""
    from mxc.runtime.distributed import initialize, setup_from

    _check_signer(args)

    try:
        setup = setup_from(args.coordinator, args.num_processes, args.process_id)
    except ValueError as err:
        raise CommandError(str(err)) from None
    prepare_cpu_devices(args.artifact, max(setup.num_processes, 1))
    initialize(setup, heartbeat_timeout_s=args.heartbeat_timeout)
    _import_in_background("orbax.checkpoint")  # after jax.distributed is up: importing it may touch devices
    return setup


def _import_in_background(module: str) -> None:
    """Starts importing `module` on a thread: orbax takes seconds to import, and the main thread
    meanwhile waits mostly in jax's C++ (loading executables, initialising parameters), so the
    import is off the path to the first step. Python's import lock makes a later import wait for it."""
    import importlib
    import threading

    thread = threading.Thread(target=importlib.import_module, args=(module,), name=f"import {module}", daemon=True)
    thread.start()
    _BACKGROUND_IMPORTS.append(thread)


# Joined before the process exits: an interpreter that shuts down while a thread is still inside
# a C++ extension's import (tensorstore, under orbax) aborts with "terminate called".
_BACKGROUND_IMPORTS: list = []


def _finish_background_imports() -> None:
    for thread in _BACKGROUND_IMPORTS:
        thread.join()


def _load(args):
    from mxc.runtime.program import load

    return load(args.artifact, trusted_keys=_trusted_keys(args))


def run_command(args) -> int:
    setup = _start_processes(args)
    import jax

    from mxc.runtime.artifact_reader import read_manifest
    from mxc.runtime.checkpoint import Checkpoints
    from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun
    from mxc.runtime.profiling import ProfileWindow
    from mxc.runtime.schedule import ScheduleRequest
    from mxc.runtime.token_file import open_tokens
    from mxc.runtime.trainable import from_program

    profile = None
    if args.profile_steps is not None:
        directory = args.profile_dir or args.tensorboard
        if directory is None:
            raise CommandError("--profile-steps needs a directory for its trace: --profile-dir DIR or --tensorboard DIR")
        profile = ProfileWindow.parse(args.profile_steps, directory)
    schedule = ScheduleRequest(
        steps=args.steps, artifact_optimizer=read_manifest(args.artifact).run.get("optimizer") or {},
        kind=args.schedule, peak=args.learning_rate, warmup_steps=args.warmup_steps, decay_steps=args.decay_steps,
        min_ratio=args.min_lr_ratio, decay_fraction=args.decay_fraction)
    schedule.fresh()  # flags that describe no schedule fail here, before the artifact loads
    program = _load(args)
    trainable = from_program(program)
    data = open_tokens(args.data, eod_id=args.eod_id)
    eval_data = None if args.eval_data is None else open_tokens(args.eval_data, eod_id=args.eod_id)
    primary = jax.process_index() == 0
    config = LoopConfig(steps=args.steps, save_every=args.save_every, eval_every=args.eval_every,
                        eval_batches=args.eval_batches, seed=args.seed, in_flight=args.in_flight,
                        log_every=args.log_every, progress=not args.quiet, fallback=args.fallback,
                        doc_mask=not args.no_doc_mask)
    run = TrainingRun(trainable, data, Checkpoints(args.ckpt_dir, keep=args.keep), config,
                      metrics_path=args.metrics, eval_data=eval_data, init_from=args.init_from, primary=primary,
                      schedule=schedule, tensorboard_dir=args.tensorboard, profile=profile)
    try:
        with StopSignal(multi_process=setup.distributed and jax.process_count() > 1) as stop:
            summary = run.run(stop)
    finally:
        run.close()
    if primary and not args.quiet:
        loss = "" if summary.last_loss is None else f", loss {summary.last_loss:.4f}"
        how = "stopped by a signal" if summary.stopped_by_signal else "done"
        print(f"{how}: step {summary.last_step}{loss}; checkpoints in {os.path.abspath(args.ckpt_dir)}",
              file=sys.stderr)
        if summary.totals is not None and summary.totals.steps:
            nominal = program.manifest.topology.platform == "cpu"
            for line in summary.totals.summary_lines(
                    summary.wall_seconds, " (mxc's nominal CPU peak: indicative only)" if nominal else ""):
                print(line, file=sys.stderr)
    return EXIT_OK


def sampling_from(args):
    from mxc.runtime.sampling import Sampling

    chosen = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                       ("--top-p", args.top_p)) if value is not None]
    if args.greedy and chosen:
        raise CommandError(f"--greedy takes the most likely token; it cannot be combined with {', '.join(chosen)}")
    if not chosen:
        return Sampling(greedy=True)
    try:
        return Sampling(greedy=False, temperature=1.0 if args.temperature is None else args.temperature,
                        top_k=args.top_k, top_p=args.top_p)
    except ValueError as err:
        raise CommandError(str(err)) from None


def generate_command(args) -> int:
    import numpy as np

    from mxc.runtime.text_generation import TextError, generation_inputs

    try:  # before starting processes: a wrong file is the user's error, whatever the artifact
        prompts, text = generation_inputs(args, args.tokenizer)
    except TextError as err:
        raise CommandError(str(err)) from None
    images = _serving_images(args.images, args.artifact, prompts)
    _start_processes(args)  # nothing may import jax before it (prompt files and tokenizers import numpy only)
    sampling = sampling_from(args)
    import jax

    from mxc.runtime.checkpoint import restore_params
    from mxc.runtime.generate import generate, servable_from_program
    from mxc.runtime.trainable import artifact_identity
    program = _load(args)
    servable = servable_from_program(program)
    # A checkpoint of another spec is refused before its arrays are read. Converted to the layout
    # the executables take here, so the stacked arrays are not held while serving.
    params = servable.prepare(restore_params(args.params, servable.abstract_params,
                                             identity=artifact_identity(program.manifest)))
    if text is not None:
        text.silent = jax.process_index() != 0
    tokens, report = generate(servable, params, prompts, args.max_new, sampling=sampling, seed=args.seed,
                              on_tokens=text.on_tokens if text is not None else None, images=images)
    if jax.process_index() == 0:
        if text is not None:
            text.finish()
        if args.output:
            np.save(args.output, tokens)
        summary = report.to_json()
        if args.report:
            with open(args.report, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        rate = report.decode_tokens_per_second_per_user
        print(f"{report.requests} requests x {report.new_tokens} new tokens: time to first token "
              f"{report.time_to_first_token_s * 1e3:.1f} ms, "
              + (f"{rate:.1f} tokens/s per user" if rate else "one token each")
              + f", {report.total_tokens_per_second:.1f} tokens/s in all", file=sys.stderr)
    return EXIT_OK


def _serving_images(path: str | None, artifact: str, prompts):
    """--images INPUTS.npz placed in the artifact's image slots (None without --images), checked
    against its manifest before anything is loaded."""
    import zipfile

    import numpy as np

    from mxc.runtime.artifact_reader import read_manifest
    from mxc.runtime.serving_images import ImageSlotError, image_slots_of

    if path is None:
        return None
    manifest = read_manifest(artifact)
    prefill = manifest.functions.get("prefill")
    slots = None if prefill is None else image_slots_of(manifest, prefill)
    if slots is None:
        raise CommandError("--images: this artifact's prefill takes no images (a vision model compiled with "
                           "mxc compile --serve takes them)")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise CommandError(f"--images: cannot read {path}: {err}") from None
    try:
        return slots.place(arrays, np.asarray(prompts), manifest.run["prompt_len"])
    except ImageSlotError as err:
        raise CommandError(str(err)) from None


def tokenize_command(args) -> int:
    from mxc.runtime.tokenize import load_tokenizer, tokenize_files

    if args.model is not None:  # image-text records: a sidecar beside the tokens
        from mxc.runtime.tokenize_images import model_tokenizer, tokenize_with_images

        tokenizer = load_tokenizer(model_tokenizer(args.model, args.tokenizer), args.eod_token)
        result = tokenize_with_images(args.inputs, args.output, tokenizer=tokenizer, model=args.model,
                                      split=args.split, text_key=args.text_key, images_key=args.images_key)
    else:
        result = tokenize_files(args.inputs, args.output, tokenizer=load_tokenizer(args.tokenizer, args.eod_token),
                                split=args.split, text_key=args.text_key)
    images = f", {result['images']:,} images" if "images" in result else ""
    print(f"{args.output}: {result['tokens']:,} tokens in {result['documents']:,} documents{images} "
          f"({result['tokenizer']}, vocabulary {result['vocab_size']:,}, end of document {result['eod_id']})",
          file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------ entry point

# The runtime's error types that are the user's to fix, by module. An error can only come from a
# module that was imported, so the check imports nothing (jax stays out of a failed tokenize).
USER_ERRORS = {
    "mxc.runtime.cli": "CommandError",
    "mxc.runtime.artifact": "ArtifactError",
    "mxc.runtime.checkpoint": "CheckpointError",
    "mxc.runtime.data": "DataError",
    "mxc.runtime.generate": "GenerationError",
    "mxc.runtime.loop": "NonFiniteLossError",
    "mxc.runtime.profiling": "ProfileStepsError",
    "mxc.runtime.schedule": "ScheduleError",
    "mxc.runtime.token_file": "TokenFileError",
    "mxc.runtime.tokenize": "TokenizerError",
    "mxc.runtime.text_generation": "TextError",
}


def is_user_error(err: BaseException) -> bool:
    return any(module in sys.modules and isinstance(err, getattr(sys.modules[module], name))
               for module, name in USER_ERRORS.items())


MODULES_FILE_VARIABLE = "MXC_RUNTIME_MODULES_FILE"


def _record_modules() -> None:
    """With MXC_RUNTIME_MODULES_FILE set, writes the names of every module this process loaded,
    one per line: the evidence that a runtime host needs no compiler (tests check it)."""
    path = os.environ.get(MODULES_FILE_VARIABLE)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(name + "\n" for name in sorted(sys.modules)))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        _finish_background_imports()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        status = args.func(args)
        _record_modules()
        return status
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if is_user_error(err):
            print(f"mxc: error: {err}", file=sys.stderr)
            return EXIT_ERROR
        if os.environ.get("MXC_DEBUG") == "1":
            raise
        print(f"mxc: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        print("mxc: this is a bug in mxc; please report it with the command line "
              "(MXC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
