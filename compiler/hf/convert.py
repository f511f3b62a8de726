"""HF checkpoint directory <-> mxc model directory.

A model directory (what `mxc import-hf` writes, what `mxc export-hf` reads):

    OUT/model.mspec    the model in the spec language
    OUT/params/        mxc's parameters, an orbax checkpoint (mxc.runtime.params_io)
    OUT/hf/            what the source checkpoint held besides weights (config.json,
                       generation_config.json, tokenizer files, ...) and layout.json:
                       which tensor sat in which shard, with which dtype and file metadata

Export writes the recorded layout and files back when the spec still matches the recorded
config.json, so an import followed by an export reproduces the safetensors byte for byte;
otherwise it writes a fresh config.json and a single (or size-sharded) safetensors file.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from mxc.compiler.hf import safetensors_io
from mxc.compiler.hf.config_in import spec_from_config
from mxc.compiler.hf.config_out import config_from_spec
from mxc.compiler.hf.families import config_for_checkpoint, renamed
from mxc.compiler.hf.mapping import LayoutError, ShapeMismatch, tensor_maps
from mxc.compiler.hf.spec_text import spec_text
from mxc.compiler.lower.params import param_shapes
from mxc.runtime.file_names import inside
from mxc.runtime.strict_json import load_json_file
from mxc.spec.ir import ModelSpec

SPEC_FILE = "model.mspec"
PARAMS_DIR = "params"
HF_DIR = "hf"
LAYOUT_FILE = "layout.json"
WEIGHT_FILES = re.compile(r".*\.safetensors$|^model\.safetensors\.index\.json$|.*\.bin$|.*\.bin\.index\.json$")
# Buffers some old checkpoints saved; they are recomputed, never parameters.
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


class ConversionError(ValueError):
    """The checkpoint and the spec disagree about the tensors."""


def model_name(cfg: dict, directory: Path) -> str:
    """A spec model name from the checkpoint's recorded name or its directory."""
    raw = Path(str(cfg.get("_name_or_path") or "")).name or directory.absolute().name
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", raw).strip("-.")
    name = re.sub(r"[.\-]{2,}", "-", name)
    return name if re.match(r"[A-Za-z_]", name or "") else f"hf-{name or 'model'}"


def _param_dtype(tensors: dict[str, np.ndarray]) -> str:
    # One shared dtype is kept as is; a mixed checkpoint is held in float32, which holds them all exactly.
    kinds = {t.dtype.name for t in tensors.values()}
    return kinds.pop() if len(kinds) == 1 and kinds <= {"float32", "bfloat16", "float16"} else "float32"


def params_from_tensors(spec: ModelSpec, tensors: dict[str, np.ndarray], model_type: str | None = None) -> dict:
    """mxc parameters (numpy, in spec.param_dtype) from HF tensors; every tensor must be used.
    model_type: the checkpoint's config.json model_type, which picks its tensor layout."""
    import jax

    dtype = np.dtype(spec.param_dtype) if spec.param_dtype != "bfloat16" else _bfloat16()
    params = jax.tree.map(lambda s: np.zeros(s.shape, dtype), param_shapes(spec))
    names = renamed(tensors, spec)
    tensors = {names.get(n, n): t for n, t in tensors.items()}
    expected = set()
    embedding = None
    for entry in tensor_maps(spec, model_type):
        if getattr(entry, "path", None) == ("embed", "embedding"):
            embedding = entry.hf_name
        expected.add(entry.hf_name)
        if entry.hf_name not in tensors:
            if getattr(entry, "optional", False):  # a copy of a parameter placed already
                continue
            raise ConversionError(f"the checkpoint has no tensor {entry.hf_name}")
        try:
            entry.write(params, tensors[entry.hf_name])
        except ShapeMismatch as error:
            raise ConversionError(str(error)) from None
    extra = {n for n in tensors if n not in expected and not IGNORED_TENSORS.match(n)}
    if spec.embedding.tied and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway; it must be the embedding itself.
        if not np.array_equal(tensors["lm_head.weight"], tensors[embedding]):
            raise ConversionError("tie_word_embeddings is set, but lm_head.weight differs from the embedding")
        extra.discard("lm_head.weight")
    if extra:
        raise ConversionError(f"the spec has no place for {len(extra)} tensor(s) of the checkpoint, e.g. "
                              + ", ".join(sorted(extra)[:3]))
    return params


def tensors_from_params(spec: ModelSpec, params, dtypes: dict[str, str] | None = None,
                        model_type: str | None = None) -> dict[str, np.ndarray]:
    """HF tensors from mxc parameters, each in dtypes[name] (default: the parameter's dtype), in
    the layout of model_type (a recorded config's) or else of the family the spec shows."""
    dtypes = dtypes or {}
    names = renamed(dtypes, spec)  # a recorded checkpoint's own spelling is written back
    original = {canonical: name for name, canonical in names.items()}
    dtypes = {names.get(n, n): d for n, d in dtypes.items()}
    out = {}
    embedding = None
    for entry in tensor_maps(spec, model_type):
        out[entry.hf_name] = _cast(entry.read(params), dtypes.get(entry.hf_name))
        if getattr(entry, "path", None) == ("embed", "embedding"):
            embedding = entry.hf_name
    if spec.embedding.tied and "lm_head.weight" in dtypes:
        out["lm_head.weight"] = _cast(out[embedding], dtypes["lm_head.weight"])
    return {original.get(n, n): t for n, t in out.items()}


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _cast(value: np.ndarray, dtype: str | None) -> np.ndarray:
    if dtype is None:
        return np.ascontiguousarray(value)
    return np.ascontiguousarray(value.astype(_bfloat16() if dtype == "bfloat16" else np.dtype(dtype)))


def _require_object(value, path: Path) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object: expected a HuggingFace config")
    return value


def _copyable(path: Path, folder: Path) -> bool:
    """Whether `path` (a file of `folder`) may be copied: a regular file, or a symlink that
    resolves inside `folder` or inside an HF cache's blobs/ (a cache snapshot is
    snapshots/<rev>/file -> ../../blobs/<hash>). Any other symlink could make mxc copy a file
    from anywhere on the machine into the model (and then into an exported checkpoint)."""
    if not path.is_file():
        return False
    if not path.is_symlink():
        return True
    folders = [folder]
    absolute = folder.absolute()
    if absolute.parent.name == "snapshots":
        folders.append(absolute.parent.parent / "blobs")
    return inside(path, folders)


class DestinationError(ValueError):
    """The output folder holds files and --force was not given."""


def _prepare_output(out_dir: Path, force: bool) -> None:
    """Refuse a non-empty output folder unless `force`; with `force`, remove only what an import
    writes (the .mspec, params/ and hf/), never other files of the user."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DestinationError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise DestinationError(f"{out_dir} is not empty (give --force to replace an imported model's "
                                   f"{SPEC_FILE}, {PARAMS_DIR}/ and {HF_DIR}/ in it)")
        for name in (PARAMS_DIR, HF_DIR):
            if (out_dir / name).is_dir() and not (out_dir / name).is_symlink():
                shutil.rmtree(out_dir / name)
            elif (out_dir / name).exists() or (out_dir / name).is_symlink():
                (out_dir / name).unlink()
        if (out_dir / SPEC_FILE).exists() or (out_dir / SPEC_FILE).is_symlink():
            (out_dir / SPEC_FILE).unlink()


def import_hf(hf_dir: str | Path, out_dir: str | Path, name: str | None = None, force: bool = False) -> ModelSpec:
    """Read a HF checkpoint directory and write an mxc model directory; returns the spec."""
    from mxc.runtime.params_io import save_params
    from mxc.spec.load import load_text

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _prepare_output(out_dir, force)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    cfg = _require_object(load_json_file(config_path), config_path)
    tensors, layout = safetensors_io.read_checkpoint(hf_dir)
    spec = spec_from_config(config_for_checkpoint(cfg, tensors), name or model_name(cfg, hf_dir),
                            _param_dtype(tensors))
    text = spec_text(spec, header=f"Imported by `mxc import-hf` from {hf_dir.absolute().name}/ "
                                  f"({cfg.get('model_type')}).")
    if load_text(text, str(out_dir / SPEC_FILE))[spec.name] != spec:
        raise AssertionError("the written .mspec does not load back to the imported spec")
    params = params_from_tensors(spec, tensors, cfg.get("model_type"))

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPEC_FILE).write_text(text)
    save_params(out_dir / PARAMS_DIR, params)
    record = out_dir / HF_DIR
    record.mkdir()
    for path in sorted(hf_dir.iterdir()):
        if not WEIGHT_FILES.match(path.name) and _copyable(path, hf_dir):
            shutil.copy2(path, record / path.name)
    (record / LAYOUT_FILE).write_text(json.dumps(layout.to_json(), indent=2) + "\n")
    return spec


def _recorded(model_dir: Path, spec: ModelSpec) -> tuple[dict, safetensors_io.Layout] | None:
    """The recorded config and layout, if they still describe `spec`."""
    record = model_dir / HF_DIR
    if not (record / "config.json").is_file() or not (record / LAYOUT_FILE).is_file():
        return None
    cfg = load_json_file(record / "config.json")
    _require_object(cfg, record / "config.json")
    layout = safetensors_io.Layout.from_json(load_json_file(record / LAYOUT_FILE), str(record / LAYOUT_FILE))
    try:
        recorded = spec_from_config(config_for_checkpoint(cfg, (n for f in layout.files for n in f.tensors)),
                                    spec.name, spec.param_dtype)
    except ValueError:
        return None
    if recorded.model_copy(update={"compute_dtype": spec.compute_dtype}) != spec.model_copy(
            update={"shard": {}, "mesh": {}}):
        return None
    return cfg, layout


def export_hf(spec: ModelSpec, params, hf_dir: str | Path, model_dir: str | Path | None = None,
              max_shard_bytes: int | None = None) -> list[Path]:
    """Write `params` of `spec` as a HF checkpoint directory; files recorded in model_dir/hf are
    written back when they still describe the spec. Returns the weight files written."""
    hf_dir = Path(hf_dir)
    recorded = _recorded(Path(model_dir), spec) if model_dir is not None else None
    if recorded is not None:
        cfg, layout = recorded
        dtypes = {name: dtype for shard in layout.files for name, dtype in shard.tensors.items()}
        tensors = tensors_from_params(spec, params, dtypes, cfg.get("model_type"))
        unknown = set(dtypes) - set(tensors) - {n for n in dtypes if IGNORED_TENSORS.match(n)}
        if unknown:
            raise LayoutError(f"the recorded layout names tensors the spec lacks, e.g. {sorted(unknown)[0]}")
        layout = _without(layout, {n for n in dtypes if n not in tensors})
    else:
        config = config_from_spec(spec)
        tensors = tensors_from_params(spec, params)
        layout = safetensors_io.default_layout(tensors, max_shard_bytes)
    written = safetensors_io.write_checkpoint(hf_dir, tensors, layout)
    if recorded is not None:
        record = Path(model_dir) / HF_DIR
        for path in sorted(record.iterdir()):
            if path.name != LAYOUT_FILE and _copyable(path, record):
                shutil.copy2(path, hf_dir / path.name)
    else:
        (hf_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def _without(layout: safetensors_io.Layout, names: set[str]) -> safetensors_io.Layout:
    files = [safetensors_io.ShardLayout(f.name, f.metadata, {n: d for n, d in f.tensors.items() if n not in names})
             for f in layout.files]
    return safetensors_io.Layout(files, layout.index_metadata, layout.sharded)
