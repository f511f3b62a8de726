"""Loading a model for inference from the command line: an imported model directory, or a spec
reference (zoo name, .mspec file, FILE.mspec:NAME) with a separate parameter checkpoint."""

from __future__ import annotations

from pathlib import Path

from mxc.compiler.hf.convert import PARAMS_DIR, SPEC_FILE
from mxc.spec.ir import ModelSpec


def is_model_dir(ref: str) -> bool:
    return (Path(ref) / SPEC_FILE).is_file()


def load_spec(ref: str) -> ModelSpec:
    from mxc.spec.load import load_model

    return load_model(str(Path(ref) / SPEC_FILE) if is_model_dir(ref) else ref)


def default_params_path(ref: str) -> Path | None:
    return Path(ref) / PARAMS_DIR if is_model_dir(ref) else None


def tokenizer_dir(ref: str) -> Path | None:
    """The model directory, when it holds a tokenizer (what import-gguf and import-hf write)."""
    from mxc.runtime.text_generation import TOKENIZER_FILE

    return Path(ref) if is_model_dir(ref) and (Path(ref) / TOKENIZER_FILE).is_file() else None


# The tokenizer files of an HF checkpoint that `mxc import-hf` places beside the model, where
# generate --prompt and tokenize --tokenizer find them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")


def copy_tokenizer(hf_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copies the tokenizer files `hf_dir` has into `out_dir`; returns their names."""
    import shutil

    from mxc.compiler.hf.convert import _copyable

    copied = []
    for name in TOKENIZER_FILES:
        source = Path(hf_dir) / name
        if _copyable(source, Path(hf_dir)):
            shutil.copy2(source, Path(out_dir) / name)
            copied.append(name)
    return copied


def load_spec_and_params(ref: str, params_path: str | None = None) -> tuple[ModelSpec, dict]:
    """The spec and its parameters, as arrays of the spec's param_dtype on one device (whatever
    mesh the checkpoint was saved from)."""
    import jax

    from mxc.compiler.lower.params import param_shapes
    from mxc.compiler.plan.plan import spec_hash
    from mxc.runtime.checkpoint import restore_params

    spec = load_spec(ref)
    path = Path(params_path) if params_path else default_params_path(ref)
    if path is None:
        raise FileNotFoundError(f"{ref} is a spec, not a model directory: give its parameters with --params CKPT")
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one_device), param_shapes(spec))
    # restore_params takes what generate --params takes: saved parameters, a run directory of
    # `mxc run --ckpt-dir` (its newest step) or one step of it; a run of another spec is refused.
    return spec, restore_params(path, target, identity={"model": spec.name, "spec_hash": spec_hash(spec)})
