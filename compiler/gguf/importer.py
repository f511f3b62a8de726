"""`mxc import-gguf`: a GGUF file to an mxc model directory, written as `mxc import-hf` writes one
(model.mspec and params/), plus the tokenizer (tokenizer.json, tokenizer_config.json).

The file is read as the HF checkpoint it was converted from (architectures.py), so the spec and
the parameter placement are the HF importer's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mxc.compiler.gguf.architectures import architecture_of, hf_config, hf_tensors
from mxc.compiler.gguf.file import GGUFError, GGUFFile, read_gguf
from mxc.compiler.gguf.tokenizer import build_tokenizer, has_tokenizer, tokenizer_config, write_tokenizer
from mxc.spec.ir import ModelSpec

# Matrices all stored in one of these keep it; any quantized or mixed file dequantizes to float32.
KEPT_DTYPES = {"F16": "float16", "BF16": "bfloat16"}


def param_dtype(gguf: GGUFFile) -> str:
    """float16 or bfloat16 when every matrix is stored so, else float32 (which holds every
    dequantized value exactly)."""
    kinds = {t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2}
    return KEPT_DTYPES[kinds.pop()] if len(kinds) == 1 and kinds <= set(KEPT_DTYPES) else "float32"


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def import_gguf(path: str | Path, out_dir: str | Path, name: str | None = None,
                force: bool = False) -> tuple[ModelSpec, bool]:
    """Read a GGUF file and write an mxc model directory with its tokenizer; returns the spec and
    whether the file held a tokenizer (a file without one imports its weights alone)."""
    from mxc.compiler.hf.config_in import ConfigError, spec_from_config
    from mxc.compiler.hf.convert import SPEC_FILE, PARAMS_DIR, _prepare_output, model_name, params_from_tensors
    from mxc.compiler.hf.spec_text import spec_text
    from mxc.runtime.params_io import save_params
    from mxc.spec.load import load_text

    path, out_dir = Path(path), Path(out_dir)
    gguf = read_gguf(path)
    architecture_of(gguf)
    dtype = param_dtype(gguf)
    cfg = hf_config(gguf, dtype)
    try:
        spec = spec_from_config(cfg, name or model_name({"_name_or_path": path.stem}, path.parent), dtype)
    except (ConfigError, KeyError) as err:
        raise GGUFError(f"{path}: {err}") from None
    text = spec_text(spec, header=f"Imported by `mxc import-gguf` from {path.name} ({gguf.architecture}, "
                                  f"{cfg['_name_or_path']}).")
    if load_text(text, str(out_dir / SPEC_FILE))[spec.name] != spec:
        raise AssertionError("the written .mspec does not load back to the imported spec")
    # Everything is built before anything is written: a refused tokenizer leaves no half-written model.
    tokenizer = (build_tokenizer(gguf), tokenizer_config(gguf)) if has_tokenizer(gguf) else None
    params = params_from_tensors(spec, hf_tensors(gguf, cfg, _numpy_dtype(dtype)))
    _prepare_output(out_dir, force)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPEC_FILE).write_text(text)
    save_params(out_dir / PARAMS_DIR, params)
    if tokenizer is not None:
        write_tokenizer(*tokenizer, out_dir)
    return spec, tokenizer is not None
