"""`mxc generate MODEL --prompt-tokens prompt.npy --max-new N -o tokens.npy` (or `--prompt TEXT
[--chat]`, the answer streamed as text): decoding with a KV cache, greedy (the default) or
sampled with temperature, top-k and top-p."""

from __future__ import annotations

import argparse

from mxc.compiler.commands import UserError
from mxc.compiler.commands.forward import add_model_arguments, load
from mxc.compiler.commands.images import add_images_argument, image_files, read_images, text_prompt_ids


def register(subparsers) -> None:
    from mxc.runtime.cli import add_generation_arguments, add_trust_arguments

    parser = subparsers.add_parser(
        "generate", help="decode new tokens after a prompt (a spec, or a compiled artifact)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode N new tokens after each prompt row with a KV cache and write prompt plus new "
                    "tokens, shape (batch, prompt + N). Greedy unless --temperature, --top-k or --top-p "
                    "asks for sampling. With --prompt TEXT the text is tokenized with the model's tokenizer "
                    "(MODEL/tokenizer.json of an imported model, or --tokenizer DIR), --chat applies its chat "
                    "template, and the answer is printed to stdout as it is decoded, up to the "
                    "end-of-sequence token.\n\n"
                    "MODEL is one of two forms:\n"
                    "  a spec or an import-hf / import-gguf directory: prefill and decode are jitted\n"
                    "    here, in --dtype;\n"
                    "  an ARTIFACT of `mxc compile --serve`: its precompiled prefill and decode run\n"
                    "    (python -m mxc.runtime generate); --params CKPT is required, the dtype is\n"
                    "    the artifact's (--dtype is refused) and --report writes the timings.")
    add_model_arguments(parser)
    add_images_argument(parser)
    parser.set_defaults(dtype=None)  # None: not given, so an artifact can refuse it when it is
    add_generation_arguments(parser)
    add_trust_arguments(parser)
    parser.set_defaults(func=handler)


def runtime_arguments(args: argparse.Namespace) -> list[str]:
    """`mxc generate ARTIFACT ...`'s parsed flags as the runtime's generate takes them (the same flags,
    from add_generation_arguments), less those of a spec."""
    if args.params is None:
        raise UserError("generating with an artifact needs --params CKPT (a checkpoint directory of mxc run)")
    if args.dtype is not None:
        raise UserError(f"--dtype does not apply to the artifact {args.model}: its compute dtype was fixed "
                        "when it was compiled (recompile with mxc compile --dtype)")
    arguments = [args.model, "--params", args.params, "--max-new", str(args.max_new), "--seed", str(args.seed)]
    for flag, given in (("--greedy", args.greedy), ("--chat", args.chat)):
        if given:
            arguments.append(flag)
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--prompt", args.prompt), ("--images", args.images),
                        ("--tokenizer", args.tokenizer), ("-o", args.output), ("--temperature", args.temperature),
                        ("--top-k", args.top_k), ("--top-p", args.top_p), ("--report", args.report)):
        if value is not None:
            arguments += [flag, str(value)]
    for key in args.trusted_key or ():
        arguments += ["--trusted-key", key]
    return arguments


def spec_servable(spec, batch: int, prompt_len: int, cache_len: int, dtype: str, images: dict | None = None):
    """The runtime's Servable over prefill and decode jitted from the spec (the functions an
    artifact's serving build compiles), so both forms of MODEL run one driver and one sampler."""
    import jax

    from mxc.compiler.lower.decode import serving_steps
    from mxc.runtime.generate import Servable

    from mxc.compiler.lower.choices import lowering_choices
    from mxc.runtime.layer_layout import per_layer_arrays

    run_prefill, run_decode = serving_steps(spec, batch, cache_len, dtype=dtype, images=images)
    per_layer = (lowering_choices().serves_per_layer(spec.quantize)
                 and not (images and "cross_attention_mask" in images))
    return Servable(prefill=jax.jit(run_prefill), decode=jax.jit(run_decode, donate_argnums=2),
                    abstract_params=None, batch=batch, prompt_len=prompt_len, cache_len=cache_len,
                    vocab_size=spec.vocab, prepare=per_layer_arrays if per_layer else Servable.prepare)


def _artifact_with_image_files(args: argparse.Namespace) -> int:
    """`mxc generate ARTIFACT --image FILE ...`: the files preprocessed here (with the artifact's
    own spec) into the inputs --images takes, which the runtime then places in the prefill's image
    slots (run in a child process, so that the temporary file is removed after it)."""
    import os
    import subprocess
    import sys
    import tempfile

    import numpy as np

    from mxc.compiler.commands.run import RUNTIME_MODULE
    from mxc.runtime.artifact_reader import read_manifest
    from mxc.runtime.text_generation import TextError, generation_inputs
    from mxc.spec.ir import ModelSpec

    if args.images:
        raise UserError("--images and --image are two ways to give the same inputs: give one")
    if args.prompt is not None:
        raise UserError("--image with an artifact takes --prompt-tokens, with the image placeholders laid out as "
                        "the processor does (a text --prompt with --image runs with a model directory)")
    arguments = runtime_arguments(args)
    try:
        prompts, _ = generation_inputs(args)
    except TextError as err:
        raise UserError(str(err)) from None
    spec = ModelSpec.model_validate(read_manifest(args.model).spec)
    inputs = read_images(None, spec, prompts, image_files(args.image, spec))
    with tempfile.TemporaryDirectory(prefix="mxc-images-") as directory:
        path = os.path.join(directory, "images.npz")
        np.savez(path, **inputs)
        sys.stdout.flush()
        sys.stderr.flush()
        return subprocess.run([sys.executable, "-m", RUNTIME_MODULE, "generate", *arguments, "--images", path]).returncode


def handler(args: argparse.Namespace) -> int:
    import numpy as np

    from mxc.compiler.commands.run import hand_over, is_artifact

    if is_artifact(args.model):  # a compiled artifact: served by the runtime's precompiled prefill/decode
        if args.image:
            return _artifact_with_image_files(args)
        return hand_over("generate", runtime_arguments(args))
    if args.trusted_key:
        raise UserError(f"--trusted-key checks an artifact's signature; {args.model} is no artifact")
    if args.report is not None:
        raise UserError("--report writes the timings of an artifact's precompiled prefill and decode; "
                        f"{args.model} is no artifact (compile it with mxc compile --serve)")

    from mxc.compiler.hf.model_dir import tokenizer_dir
    from mxc.runtime.cli import CommandError, sampling_from
    from mxc.runtime.generate import GenerationError, generate
    from mxc.runtime.text_generation import TextError, generation_inputs

    try:
        sampling = sampling_from(args)
        prompts, text = generation_inputs(args, tokenizer_dir(args.model))
    except (CommandError, TextError) as err:
        raise UserError(str(err)) from None
    spec, params = load(args)
    files = image_files(getattr(args, "image", None), spec)
    if files and text is not None:  # the prompt's image markers expanded as the processor does
        prompts = text_prompt_ids(text.tokenizer, args.prompt, args.chat, spec, files)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise UserError(f"--prompt-tokens {args.prompt_tokens} needs at least one token per row, shape "
                        f"(requests, prompt), not {list(prompts.shape)}")
    width = prompts.shape[1]
    # Every prompt row is prefilled in one group, so the images' order follows the rows'.
    images = read_images(getattr(args, "images", None), spec, prompts, files)
    servable = spec_servable(spec, max(len(prompts), 1), width, width + max(args.max_new, 1) - 1,
                             args.dtype or "float32", images=images or None)
    try:
        tokens, _ = generate(servable, params, prompts, args.max_new, sampling=sampling, seed=args.seed,
                             on_tokens=text.on_tokens if text is not None else None)
    except GenerationError as err:
        source = "--prompt" if text is not None else f"--prompt-tokens {args.prompt_tokens}"
        raise UserError(f"{source}: {err}") from None
    if text is not None:
        text.finish()
    if args.output:
        np.save(args.output, tokens.astype(prompts.dtype))
    return 0

