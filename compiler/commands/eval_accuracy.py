"""`mxc eval accuracy MODEL|ARTIFACT --text FILE`: teacher-forced token accuracy against a
full-precision reference, and tokens/s per user and time to first token at batch 1, as one row of
the serving table (mxc.runtime.accuracy has the method)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mxc.compiler.commands import UserError

TABLE_HEADER = ("| Model | Device | Precision | Top-1 (%) | Top-5 (%) | Speed (t/s/u) | TTFT (ms) |\n"
                "| --- | --- | --- | --- | --- | --- | --- |")
BYTES = "bytes"  # --tokenizer bytes: the byte-level tokenizer (ids 0-255), for models without one


def register(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="measure a model: token accuracy and serving speed",
                                     description="Measurements of a model or a compiled artifact.")
    kinds = evaluate.add_subparsers(title="measurements", metavar="MEASUREMENT")
    evaluate.set_defaults(func=lambda args: _usage(evaluate))  # `mxc eval` alone: which measurements there are
    parser = kinds.add_parser(
        "accuracy", help="teacher-forced top-1/top-5 accuracy against a full-precision reference, and speed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Teacher-forced token accuracy: the reference (full precision) runs once over the text's "
                    "first PREFILL + DECODE + 1 tokens and keeps its top-5 per position; MODEL prefills PREFILL "
                    "tokens, then decodes DECODE steps fed with the text's own next tokens (never its "
                    "predictions). Top-1: MODEL's argmax equals the reference's first; top-5: it is among "
                    "the reference's five. Then greedy generation at batch 1 after the text's first 128 "
                    "tokens (at most 200 decode steps, after one warm-up request) gives tokens/s per user and "
                    "the time to first token. Prints the serving table's header and this row in markdown "
                    "(--json: an object).\n\n"
                    "MODEL is a spec or import-hf directory (its serving functions are jitted here, in "
                    "--dtype) or an ARTIFACT of `mxc compile --serve` with --params CKPT.\n"
                    "The reference: --reference REF.npz (written by --save-reference), or a directory of a "
                    "full-precision model run here in float32; by default MODEL itself in float32 (not for "
                    "an artifact).")
    parser.add_argument("model", metavar="MODEL|ARTIFACT")
    parser.add_argument("--params", metavar="CKPT", help="parameter checkpoint (default: MODEL/params)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="compute dtype of a spec or model directory (default: float32)")
    parser.add_argument("--quantize", metavar="CONFIG",
                        help="serve a spec or model directory at this precision (int8, w8a8, int4, int4-mlp, fp8, "
                             "bf16, int8-kv, ...; docs/quantization.md): its weights quantized here as `mxc "
                             "quantize` does, then the same serving functions as `mxc compile --quantize` runs")
    parser.add_argument("--only", choices=("accuracy", "speed"),
                        help="measure only the accuracy (no speed run) or only the speed (no reference needed)")
    parser.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to measure on")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer.json, a sentencepiece .model, a directory holding tokenizer.json, or "
                             f"'{BYTES}' (default: the one in MODEL's or the reference's directory)")
    parser.add_argument("--reference", metavar="REF.npz|DIR", help="stored reference, or a full-precision model")
    parser.add_argument("--save-reference", metavar="REF.npz", help="write the reference used here")
    parser.add_argument("--prefill", type=int, default=512, metavar="N", help="tokens prefilled (default 512)")
    parser.add_argument("--decode", type=int, default=511, metavar="N", help="teacher-forced decode steps (default 511)")
    parser.add_argument("--speed-prompt", type=int, default=128, metavar="N",
                        help="prompt tokens of the speed measurement (default 128)")
    parser.add_argument("--speed-steps", type=int, default=200, metavar="N",
                        help="at most this many decode steps timed (default 200)")
    parser.add_argument("--name", metavar="TEXT", help="the row's model name (default: the spec's name)")
    parser.add_argument("--precision", metavar="TEXT",
                        help="the row's precision (default: from the artifact's manifest or --dtype)")
    parser.add_argument("--segments", action="store_true", help="also print the scores per 100 positions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the row")
    parser.set_defaults(func=handler)


def _usage(parser: argparse.ArgumentParser) -> int:
    import sys

    parser.print_help(sys.stderr)
    return 2


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.run import is_artifact
    from mxc.runtime.accuracy import AccuracyError, check_reference, measure_speed, score, teacher_forced_predictions

    artifact = is_artifact(args.model)
    if artifact and args.dtype is not None:
        raise UserError(f"--dtype does not apply to the artifact {args.model}: its compute dtype was fixed "
                        "when it was compiled")
    if artifact and args.params is None:
        raise UserError("measuring an artifact needs --params CKPT")
    if artifact and args.quantize is not None:
        raise UserError(f"--quantize does not apply to the artifact {args.model}: its precision was fixed when it "
                        "was compiled (mxc compile --quantize)")
    if artifact and args.reference is None and args.only != "speed":
        raise UserError(f"{args.model} is an artifact: give the full-precision reference with --reference "
                        "REF.npz or --reference MODEL_DIR")
    if args.prefill < 1 or args.decode < 0 or args.speed_prompt < 1 or args.speed_steps < 1:
        raise UserError("--prefill, --speed-prompt and --speed-steps must be at least 1, --decode at least 0")
    if args.quantize is not None:
        from mxc.compiler.commands.compile import quantization_name

        quantization_name(args.quantize)  # a misspelt name fails before anything is loaded
    tokenizer = _tokenizer(args)
    tokens = _text_tokens(args.text, tokenizer, args.prefill + args.decode + 1)

    if artifact:
        servable, params, speed_servable, name, precision = _artifact(args)
    else:
        servable, params, speed_servable, name, precision = _spec_model(args)
    _check_vocabulary(tokens, servable.vocab_size, args.text)
    result = {"model": args.name or name, "device": device_label(), "precision": args.precision or precision,
              "top1": None, "top5": None, "tokens_per_second_per_user": None, "ttft_ms": None,
              "prefill": args.prefill, "decode": args.decode, "text": os.path.basename(args.text)}
    try:
        if args.only != "speed":
            reference = _reference(args, tokens)
            check_reference(reference, tokens, args.reference or args.model)
            if args.save_reference:
                reference.save(args.save_reference)
            predictions = teacher_forced_predictions(servable, params, tokens, args.prefill, args.decode)
            scores = score(predictions, reference, args.prefill)
            result.update(top1=round(scores.top1, 2), top5=round(scores.top5, 2), scored_positions=scores.positions,
                          scored_against="reference",
                          segments=[{"first_position": first, "top1": round(top1, 2), "top5": round(top5, 2)}
                                    for first, top1, top5 in scores.segments])
        if args.only != "accuracy":
            speed = measure_speed(speed_servable, params, tokens, args.speed_prompt, args.speed_steps)
            result.update(tokens_per_second_per_user=round(speed.tokens_per_second_per_user, 2),
                          ttft_ms=round(speed.ttft_ms, 1), speed_prompt_tokens=speed.prompt_tokens,
                          speed_decode_steps=speed.decode_steps, speed_prefill_width=speed.prefill_width)
    except AccuracyError as err:
        raise UserError(str(err)) from None

    if args.json:
        print(json.dumps(result))
        return 0
    print(TABLE_HEADER)
    print(table_row(result))
    if args.segments:
        for segment in result.get("segments", ()):
            print(f"positions from {segment['first_position']}: top-1 {segment['top1']:.1f}%, "
                  f"top-5 {segment['top5']:.1f}%")
    return 0


def table_row(result: dict) -> str:
    """One markdown row; a measurement not taken (--only) is a dash."""
    def cell(key: str, digits: int) -> str:
        value = result.get(key)
        return "–" if value is None else f"{value:.{digits}f}"

    return (f"| {result['model']} | {result['device']} | {result['precision']} | {cell('top1', 1)} | "
            f"{cell('top5', 1)} | {cell('tokens_per_second_per_user', 1)} | {cell('ttft_ms', 0)} |")


def device_label() -> str:
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"CPU ({os.cpu_count()} cores)"
    count = jax.device_count()
    return device.device_kind + (f" x{count}" if count > 1 else "")


def _tokenizer(args):
    from mxc.runtime.tokenize import TokenizerError, byte_tokenizer, load_tokenizer

    if args.tokenizer == BYTES:
        return byte_tokenizer()
    path = args.tokenizer
    if path is None:
        candidates = [Path(ref) / "tokenizer.json" for ref in (args.model, args.reference) if ref]
        path = next((str(c) for c in candidates if c.is_file()), None)
        if path is None:
            raise UserError(f"no tokenizer.json beside {args.model}" + (f" or {args.reference}" if args.reference else "")
                            + f": name one with --tokenizer PATH (or --tokenizer {BYTES} for byte-level ids)")
    elif Path(path).is_dir():
        path = str(Path(path) / "tokenizer.json")
    if not Path(path).is_file():
        raise UserError(f"--tokenizer {path}: no such file")
    try:
        return load_tokenizer(path)
    except TokenizerError as err:
        raise UserError(str(err)) from None


def _text_tokens(path: str, tokenizer, needed: int):
    import numpy as np

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--text {path}: cannot read it as UTF-8 text ({err})") from None
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    if len(tokens) < needed:
        raise UserError(f"--text {path} has {len(tokens)} tokens; --prefill and --decode need {needed}")
    return tokens[:needed]


def _check_vocabulary(tokens, vocab: int, path: str) -> None:
    if tokens.max(initial=0) >= vocab:
        raise UserError(f"--text {path} tokenizes to ids up to {int(tokens.max())}, outside the model's "
                        f"vocabulary of {vocab}: is it the model's tokenizer?")


def _spec_model(args):
    from mxc.compiler.commands.forward import load
    from mxc.compiler.commands.generate import spec_servable

    spec, params = load(args)
    dtype = args.dtype or "float32"
    if args.quantize is not None:
        spec, params = _quantized(spec, params, args.quantize)
    cache = args.prefill + args.decode
    # The prefill is as wide as the measurement's, so that the accuracy's prefill is one call; the
    # speed's own prefill is the prompt's width (an artifact has one width for both).
    servable = spec_servable(spec, 1, args.prefill, cache, dtype)
    speed_cache = max(cache, args.speed_prompt + args.speed_steps)
    speed = (servable if (args.speed_prompt, speed_cache) == (args.prefill, cache)
             else spec_servable(spec, 1, args.speed_prompt, speed_cache, dtype))
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    if spec.quantize not in (None, "fp32", precision):
        precision = f"{spec.quantize} ({precision} compute)"
    return servable, params, speed, spec.name, precision


def _quantized(spec, params, name: str):
    """The spec at quantization `name` and its parameters quantized as `mxc quantize` writes them."""
    import jax

    from mxc.compiler.commands.compile import quantization_name, with_quantization
    from mxc.compiler.quant.config import parse
    from mxc.compiler.quant.params import quantize_params

    spec = with_quantization(spec, quantization_name(name))
    config = parse(spec.quantize)
    if config.quantizes_weights:
        params = jax.jit(lambda p: quantize_params(spec, p, config))(params)
    return spec, params


def _artifact(args):
    from mxc.runtime.checkpoint import restore_params
    from mxc.runtime.generate import GenerationError, servable_from_program
    from mxc.runtime.program import load
    from mxc.runtime.trainable import artifact_identity

    program = load(args.model)
    try:
        servable = servable_from_program(program)
    except GenerationError as err:
        raise UserError(str(err)) from None
    params = restore_params(args.params, servable.abstract_params, identity=artifact_identity(program.manifest))
    return servable, params, servable, program.manifest.spec.get("name", "?"), artifact_precision(program.manifest)


def artifact_precision(manifest) -> str:
    """The compute dtype and, where the artifact was compiled with one, its quantization configuration."""
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(manifest.spec.get("compute_dtype"), "?")
    quantized = manifest.spec.get("quantize")  # the configuration it was compiled with (mxc compile --quantize)
    return f"{quantized} ({dtype} compute)" if quantized not in (None, dtype) else dtype


def _reference(args, tokens):
    """The reference top-5 over `tokens`: loaded, or computed by a full-precision forward pass."""
    from mxc.runtime.accuracy import AccuracyError, Reference

    if args.reference and Path(args.reference).is_file():
        try:
            return Reference.load(args.reference)
        except AccuracyError as err:
            raise UserError(str(err)) from None
    ref_args = argparse.Namespace(model=args.reference or args.model,
                                  params=None if args.reference else args.params)
    return reference_by_forward(ref_args, tokens)


def reference_by_forward(ref_args: argparse.Namespace, tokens):
    """One float32 forward pass of a model over tokens [n] -> its top-5 per position."""
    import jax
    import numpy as np

    from mxc.compiler.commands.forward import load
    from mxc.compiler.lower.model import forward
    from mxc.runtime.accuracy import TOP_K, Reference

    spec, params = load(ref_args)
    _check_vocabulary(tokens, spec.vocab, "(the reference's vocabulary)")
    # The top-5 on the device: the full logits of 1,024 positions of a large vocabulary are 200 MB.
    top5 = jax.jit(lambda p, t: jax.lax.top_k(forward(spec, p, t, dtype="float32")[0][0].astype("float32"), TOP_K)[1])
    ids = np.asarray(top5(params, tokens[None].astype(np.int32)))
    return Reference(np.asarray(tokens, np.int32), ids.astype(np.int32))
