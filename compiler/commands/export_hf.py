"""`mxc export-hf MODEL -o HF_DIR`: an mxc model back to a HuggingFace checkpoint directory."""

from __future__ import annotations

import argparse
import re

from mxc.compiler.commands import UserError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export-hf", help="export a model as a HuggingFace checkpoint",
        description="Write MODEL (a directory from import-hf, or a spec with --params CKPT) as a HuggingFace "
                    "checkpoint: config.json and safetensors. A model imported with import-hf is written "
                    "back with its original files, shards and dtypes; the tokenizer files of a model "
                    "directory (import-hf's or import-gguf's) are written beside the weights.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("-o", "--output", required=True, metavar="HF_DIR")
    parser.add_argument("--params", metavar="CKPT", help="parameter checkpoint (default: MODEL/params)")
    parser.add_argument("--max-shard-size", type=parse_size, metavar="SIZE",
                        help="split a new checkpoint into shards of at most SIZE (e.g. 5GB)")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.hf.convert import export_hf
    from mxc.compiler.hf.model_dir import copy_tokenizer, is_model_dir, load_spec_and_params

    model_dir = args.model if is_model_dir(args.model) else None
    try:
        spec, params = load_spec_and_params(args.model, args.params)
        written = export_hf(spec, params, args.output, model_dir=model_dir, max_shard_bytes=args.max_shard_size)
        # The tokenizer travels with the weights, as import-hf brought it in: generate --prompt,
        # transformers' AutoTokenizer and a later import-hf read it there.
        tokenizer = copy_tokenizer(model_dir, args.output) if model_dir is not None else []
    except (OSError, ValueError) as err:
        raise UserError(f"cannot export {args.model}: {err}") from None
    print(f"exported {spec.name} to {args.output} ({len(written)} file(s)"
          + (f"; tokenizer: {', '.join(tokenizer)}" if tokenizer else "") + ")")
    return 0
