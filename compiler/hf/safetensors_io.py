"""HF checkpoint files: safetensors shards, with or without model.safetensors.index.json.

Reading keeps a Layout (which tensor sits in which file, with which dtype and file metadata) so
that writing can reproduce the original files byte for byte: the safetensors library orders a
file's header and data itself, so the same tensors and metadata give the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from mxc.runtime.file_names import plain_name
from mxc.runtime.strict_json import load_json_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class ShardLayout:
    name: str  # file name inside the checkpoint directory
    metadata: dict[str, str] | None
    tensors: dict[str, str]  # tensor name -> numpy dtype name, in the file's order


@dataclass
class Layout:
    files: list[ShardLayout]
    index_metadata: dict | None = None  # the index's "metadata"; None for an unsharded checkpoint
    sharded: bool = False

    def dtype_of(self, name: str) -> str | None:
        return next((f.tensors[name] for f in self.files if name in f.tensors), None)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, source: str = "layout.json") -> "Layout":
        """The layout recorded in `data` (read from `source`, which errors name)."""
        try:
            files = [ShardLayout(**f) for f in data["files"]]
            layout = cls(files=files, index_metadata=data.get("index_metadata"), sharded=data.get("sharded", False))
            for shard in files:
                if not isinstance(shard.tensors, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) for k, v in shard.tensors.items()):
                    raise TypeError("a file's tensors must map names to dtype names")
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{source} is not a checkpoint layout ({type(err).__name__}: {err})") from None
        for shard in files:
            plain_name(shard.name, source)
        return layout


def _shard_names(directory: Path) -> tuple[list[str], dict | None]:
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            data = load_json_file(index)
            weight_map = data["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
        return sorted(plain_name(n, str(index)) for n in names), data.get("metadata")
    names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {directory} (mxc imports safetensors checkpoints only)")
    return names, None


def read_checkpoint(directory: str | Path) -> tuple[dict[str, np.ndarray], Layout]:
    """Every tensor of the checkpoint, by name, as numpy arrays in their stored dtype."""
    directory = Path(directory)
    names, index_metadata = _shard_names(directory)
    tensors: dict[str, np.ndarray] = {}
    files = []
    for name in names:
        shard, metadata = _read_shard(directory / name)
        duplicated = set(shard) & set(tensors)
        if duplicated:
            raise ValueError(f"tensor {sorted(duplicated)[0]} appears in more than one shard of {directory}")
        tensors.update(shard)
        files.append(ShardLayout(name, metadata, {k: v.dtype.name for k, v in shard.items()}))
    return tensors, Layout(files, index_metadata, sharded=(directory / INDEX_NAME).is_file())


def _read_shard(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str] | None]:
    """One safetensors file's tensors and metadata; any error reading it names the file."""
    try:
        with safe_open(path, framework="numpy") as f:
            shard = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata()
    except OSError:
        raise
    except Exception as err:  # the safetensors library raises its own SafetensorError (and others) on bad files
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    for key, value in shard.items():
        # Weights are floating point; an integer dtype means a relabelled or quantized file that
        # a cast would silently turn into garbage.
        if not (np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16"):
            raise ValueError(f"{path}: tensor {key} has dtype {value.dtype.name}; mxc imports floating point "
                             f"weights only")
    return shard, metadata


def write_checkpoint(directory: str | Path, tensors: dict[str, np.ndarray], layout: Layout) -> list[Path]:
    """Write `tensors` into the files `layout` names (and the index when sharded)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for shard in layout.files:
        plain_name(shard.name, "the checkpoint layout")
        part = {name: np.ascontiguousarray(tensors[name]) for name in shard.tensors}
        save_file(part, directory / shard.name, metadata=shard.metadata)
        written.append(directory / shard.name)
    if layout.sharded:
        weight_map = {name: shard.name for shard in layout.files for name in shard.tensors}
        metadata = layout.index_metadata
        if metadata is None:
            metadata = {"total_parameters": int(sum(t.size for t in tensors.values())),
                        "total_size": int(sum(t.nbytes for t in tensors.values()))}
        index = {"metadata": metadata, "weight_map": weight_map}
        # transformers' own spelling of the index, so an unchanged model writes the same bytes.
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(directory / INDEX_NAME)
    return written


def default_layout(tensors: dict[str, np.ndarray], max_shard_bytes: int | None = None) -> Layout:
    """A layout for tensors with no original: one file, or shards of at most max_shard_bytes."""
    names = list(tensors)
    if max_shard_bytes is None or sum(t.nbytes for t in tensors.values()) <= max_shard_bytes:
        return Layout([ShardLayout(SINGLE_NAME, {"format": "pt"}, {n: tensors[n].dtype.name for n in names})])
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + tensors[name].nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += tensors[name].nbytes
    count = len(groups)
    files = [ShardLayout(f"model-{i + 1:05d}-of-{count:05d}.safetensors", {"format": "pt"},
                         {n: tensors[n].dtype.name for n in group}) for i, group in enumerate(groups)]
    return Layout(files, None, sharded=True)
