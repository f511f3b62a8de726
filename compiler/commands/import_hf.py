"""`mxc import-hf HF_DIR -o OUT`: a HuggingFace checkpoint to an mxc model directory (the .mspec
and an orbax checkpoint of mxc's parameters)."""

from __future__ import annotations

import argparse

from mxc.compiler.commands import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-hf", help="import a HuggingFace checkpoint (config.json + safetensors)",
        description="Read a HuggingFace checkpoint directory (config.json and *.safetensors, sharded with "
                    "model.safetensors.index.json or not) of a Llama 2/3, Mistral, Gemma 1/2/3, Qwen2, Qwen3 or "
                    "Phi-3 dense model (or one of the MoE families: docs/hf-import.md), and write OUT/model.mspec, OUT/params/ (orbax), OUT/hf/ (what "
                    "export-hf needs to write the checkpoint back as it was) and, beside the model, the "
                    "checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json, ...) for "
                    "mxc generate --prompt.")
    parser.add_argument("hf_dir", metavar="HF_DIR")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="the model directory to write")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty OUT: replaces its model.mspec, params/ and hf/ only")
    parser.add_argument("--name", help="model name in the .mspec (default: from the checkpoint)")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.analysis import summarize
    from mxc.compiler.hf.convert import import_hf
    from mxc.compiler.hf.model_dir import copy_tokenizer

    try:
        spec = import_hf(args.hf_dir, args.output, name=args.name, force=args.force)
        copy_tokenizer(args.hf_dir, args.output)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot import {args.hf_dir}: {err}") from None
    total = summarize(spec).total_params
    print(f"imported {spec.name} ({total:,} parameters, {spec.num_layers} layers) into {args.output}")
    return 0
