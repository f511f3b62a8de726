"""`mxc import-gguf FILE.gguf -o OUT`: a llama.cpp GGUF file to an mxc model directory (the .mspec,
parameters dequantized to the spec's dtype, and the tokenizer)."""

from __future__ import annotations

import argparse

from mxc.compiler.commands import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-gguf", help="import a llama.cpp GGUF file (weights dequantized, tokenizer included)",
        description="Read a GGUF file of a llama, mistral, qwen2, qwen3, qwen3moe, gemma, gemma2 or gemma3 "
                    "model (Mixtral as llama with experts) with F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 "
                    "or K-quant tensors, and write OUT/model.mspec, OUT/params/ (orbax; every tensor "
                    "dequantized to the spec's param_dtype: float16/bfloat16 when every matrix is stored so, "
                    "else float32) and the tokenizer from the file's metadata: OUT/tokenizer.json and "
                    "OUT/tokenizer_config.json (special tokens and chat template).")
    parser.add_argument("gguf_file", metavar="FILE.gguf")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="the model directory to write")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty OUT: replaces its model.mspec, params/ and tokenizer files")
    parser.add_argument("--name", help="model name in the .mspec (default: from the file name)")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.analysis import summarize
    from mxc.compiler.gguf.importer import import_gguf

    try:
        spec, with_tokenizer = import_gguf(args.gguf_file, args.output, name=args.name, force=args.force)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot import {args.gguf_file}: {err}") from None
    total = summarize(spec).total_params
    print(f"imported {spec.name} ({total:,} parameters, {spec.num_layers} layers, {spec.param_dtype}) "
          f"into {args.output}" + ("" if with_tokenizer else " (the file holds no tokenizer: none written)"))
    return 0
