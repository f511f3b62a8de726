"""`mxc quantize MODEL --config C -o Q`: a checkpoint of quantized weights for serving.

MODEL is a model directory (from import-hf) or a spec with --params. The output is a parameter
checkpoint (orbax, as save_params writes) of the tree a quantized artifact's prefill and decode
take: each quantized kernel's values (int8, int4 or float8) beside its float32 scales
(compiler/quant/params.py). Prints the sizes of the float, bfloat16 and quantized trees.
"""

from __future__ import annotations

import argparse
import json
import os

from mxc.compiler.commands import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize", help="write a checkpoint of quantized weights for a quantized artifact",
        description="Quantize MODEL's parameters as CONFIG says (docs/quantization.md) and save them: "
                    "the checkpoint `mxc generate ARTIFACT --params` takes for an artifact compiled with "
                    "--quantize CONFIG.")
    parser.add_argument("model", metavar="MODEL",
                        help="a directory from import-hf, or a spec (zoo name, .mspec, FILE.mspec:NAME) with --params")
    parser.add_argument("--params", metavar="CKPT", help="parameter checkpoint (default: MODEL/params)")
    parser.add_argument("--config", required=True, metavar="CONFIG",
                        help="int8, w8a8, int4, int4-mlp, fp8 or bf16 (a +int8-kv part changes no weights)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="the checkpoint directory to write")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--json", action="store_true", help="print the sizes as JSON")
    parser.set_defaults(func=handler)


def tree_bytes(tree, itemsize: float | None = None) -> int:
    """Bytes of a tree's arrays (int4 counts half a byte); with `itemsize` as if every leaf had it."""
    import jax
    import numpy as np

    total = 0.0
    for leaf in jax.tree.leaves(tree):
        size = itemsize if itemsize is not None else np.dtype(leaf.dtype).itemsize * (0.5 if "int4" in str(leaf.dtype) else 1)
        total += leaf.size * size
    return int(total)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def handler(args: argparse.Namespace) -> int:
    from mxc.compiler.commands.forward import load
    from mxc.compiler.commands.units import size_bytes
    from mxc.compiler.quant.config import QuantizationError, parse

    try:
        config = parse(args.config)
    except QuantizationError as err:
        raise UserError(f"--config: {err}") from None
    if not config.quantizes_weights:
        raise UserError(f"--config {args.config} quantizes no weights: its artifact takes the float checkpoint")
    if os.path.exists(args.output) and not args.force:
        raise UserError(f"{args.output} exists; give --force to replace it")
    spec, params = load(args)

    from mxc.compiler.quant.params import quantize_params
    from mxc.runtime.params_io import save_params

    quantized = quantize_params(spec, params, config)
    save_params(args.output, quantized)
    sizes = {"config": config.name, "float_bytes": tree_bytes(params), "bfloat16_bytes": tree_bytes(params, 2),
             "quantized_bytes": tree_bytes(quantized), "checkpoint_bytes": directory_bytes(args.output),
             "output": os.path.abspath(args.output)}
    sizes["ratio_to_bfloat16"] = round(sizes["quantized_bytes"] / sizes["bfloat16_bytes"], 4)
    if args.json:
        print(json.dumps(sizes, indent=2))
    else:
        print(f"{args.output}: {config.name} parameters {size_bytes(sizes['quantized_bytes'])} "
              f"({sizes['ratio_to_bfloat16']:.2f} of bfloat16's {size_bytes(sizes['bfloat16_bytes'])}; "
              f"{spec.param_dtype} {size_bytes(sizes['float_bytes'])}), checkpoint on disk "
              f"{size_bytes(sizes['checkpoint_bytes'])}")
    return 0
