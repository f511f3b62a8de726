"""`mxc forward MODEL --tokens tokens.npy -o logits.npy`: the forward pass on token ids."""

from __future__ import annotations

import argparse

from mxc.compiler.commands import UserError
from mxc.compiler.commands.images import add_images_argument, image_files, read_images

DTYPES = ("float32", "bfloat16", "float16")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a directory from import-hf, or a spec (zoo name, .mspec, FILE.mspec:NAME) with --params")
    parser.add_argument("--params", metavar="CKPT", help="parameter checkpoint (default: MODEL/params)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default: float32)")


def read_tokens(path: str, vocab: int, flag: str):
    import numpy as np

    from mxc.runtime.prompt_file import PromptFileError, read_prompt_array

    try:
        tokens = read_prompt_array(path, flag)
    except PromptFileError as err:
        raise UserError(str(err)) from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"{flag} must hold integer token ids of shape (batch, seq), "
                        f"not {tokens.dtype}{list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise UserError(f"{flag} has ids outside the vocabulary [0, {vocab})")
    return tokens


def load(args):
    from mxc.compiler.hf.model_dir import load_spec_and_params

    try:
        return load_spec_and_params(args.model, args.params)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load {args.model}: {err}") from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "forward", help="run the forward pass on token ids and save the logits",
        description="Run MODEL on int token ids of shape (batch, seq) from a .npy file and write the logits, "
                    "shape (batch, seq, vocab), as float32 .npy.")
    add_model_arguments(parser)
    parser.add_argument("--tokens", required=True, metavar="TOKENS.npy")
    parser.add_argument("-o", "--output", required=True, metavar="LOGITS.npy")
    add_images_argument(parser)
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from mxc.compiler.lower.model import forward

    spec, params = load(args)
    tokens = read_tokens(args.tokens, spec.vocab, "--tokens")
    images = read_images(args.images, spec, tokens, image_files(args.image, spec))
    if "cross_attention_mask" in images:  # Llama 3.2 Vision's image layers
        from mxc.compiler.lower.cross_attention import forward_with_inputs

        run = jax.jit(lambda p, t, images: forward_with_inputs(spec, p, t, dtype=args.dtype, **images))
    else:
        run = jax.jit(lambda p, t, images: forward(spec, p, t, dtype=args.dtype, **images)[0])
    logits = np.asarray(run(params, tokens.astype(np.int32), images), dtype=np.float32)
    np.save(args.output, logits)
    return 0
