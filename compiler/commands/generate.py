"""`mxc generate MODEL --prompt-tokens prompt.npy --max-new N -o tokens.npy`: decoding with a KV
cache, greedy (the default) or sampled with temperature, top-k and top-p."""

from __future__ import annotations

import argparse

from mxc.compiler.commands import UserError
from mxc.compiler.commands.forward import add_model_arguments, load, read_tokens


def register(subparsers) -> None:
    from mxc.runtime.cli import add_generation_arguments

    parser = subparsers.add_parser(
        "generate", help="decode new tokens after a prompt (a spec, or a compiled artifact)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode N new tokens after each prompt row with a KV cache and write prompt plus new "
                    "tokens, shape (batch, prompt + N). Greedy unless --temperature, --top-k or --top-p "
                    "asks for sampling.\n\n"
                    "MODEL is one of two forms:\n"
                    "  a spec or import-hf directory: prefill and decode are jitted here, in --dtype;\n"
                    "  an ARTIFACT of `mxc compile --serve`: its precompiled prefill and decode run\n"
                    "    (python -m mxc.runtime generate); --params CKPT is required, the dtype is\n"
                    "    the artifact's (--dtype is refused) and --report writes the timings.")
    add_model_arguments(parser)
    parser.set_defaults(dtype=None)  # None: not given, so an artifact can refuse it when it is
    add_generation_arguments(parser)
    parser.set_defaults(func=handler)


def runtime_arguments(args: argparse.Namespace) -> list[str]:
    """`mxc generate ARTIFACT ...`'s parsed flags as the runtime's generate takes them (the same flags,
    from add_generation_arguments), less those of a spec."""
    if args.params is None:
        raise UserError("generating with an artifact needs --params CKPT (a checkpoint directory of mxc run)")
    if args.dtype is not None:
        raise UserError(f"--dtype does not apply to the artifact {args.model}: its compute dtype was fixed "
                        "when it was compiled (recompile with mxc compile --dtype)")
    arguments = [args.model, "--params", args.params, "--prompt-tokens", args.prompt_tokens,
                 "--max-new", str(args.max_new), "--seed", str(args.seed), "-o", args.output]
    if args.greedy:
        arguments.append("--greedy")
    for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p),
                        ("--report", args.report)):
        if value is not None:
            arguments += [flag, str(value)]
    return arguments


def sampler_from_args(args: argparse.Namespace):
    from mxc.compiler.lower.decode import Sampler

    sampling = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                         ("--top-p", args.top_p)) if value is not None]
    if args.greedy and sampling:
        raise UserError(f"--greedy takes the argmax; it cannot be combined with {', '.join(sampling)}")
    if not sampling:
        return Sampler(greedy=True)
    try:
        return Sampler(temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k, top_p=args.top_p)
    except ValueError as err:
        raise UserError(str(err)) from None


def handler(args: argparse.Namespace) -> int:
    import numpy as np

    from mxc.compiler.commands.run import hand_over, is_artifact

    if is_artifact(args.model):  # a compiled artifact: served by the runtime's precompiled prefill/decode
        return hand_over("generate", runtime_arguments(args))
    if args.report is not None:
        raise UserError("--report writes the timings of an artifact's precompiled prefill and decode; "
                        f"{args.model} is no artifact (compile it with mxc compile --serve)")

    from mxc.compiler.lower.decode import generate

    sampler = sampler_from_args(args)
    spec, params = load(args)
    prompt = read_tokens(args.prompt_tokens, spec.vocab, "--prompt-tokens")
    if prompt.shape[1] == 0:
        raise UserError("--prompt-tokens needs at least one token per row")
    tokens = generate(spec, params, prompt, args.max_new, sampler=sampler, seed=args.seed,
                      dtype=args.dtype or "float32")
    np.save(args.output, np.asarray(tokens).astype(prompt.dtype))
    return 0
