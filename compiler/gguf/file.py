"""Reading a GGUF file: its metadata as plain Python values and its tensors dequantized.

Dequantization is the `gguf` package's (llama.cpp's own Python reference); this module only
decides which tensor types are weights mxc imports and turns every failure into a GGUFError
that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The tensor types mxc imports: plain floats, the legacy block quants and the K-quants.
IMPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(ValueError):
    """A GGUF file mxc cannot read or import; the message names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType's name: F32, Q4_1, ...
    shape: tuple[int, ...]  # numpy order (the reverse of ggml's ne), as HF stores the weight
    raw: np.ndarray  # the stored data: floats, or uint8 blocks of one row per leading index


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict  # key -> str, int, float, bool or list of them
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def dequantized(self, name: str, dtype=np.float32, index: int | None = None) -> np.ndarray:
        """The tensor `name` (or its slice `index` along the first axis: one expert of a stacked
        tensor, read alone) as floats of `dtype`, shaped as numpy (and HF) order it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        raw, shape = (tensor.raw, tensor.shape) if index is None else (tensor.raw[index], tensor.shape[1:])
        values = dequantize(raw, GGMLQuantizationType[tensor.type_name])
        return np.asarray(values).reshape(shape).astype(dtype, copy=False)


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor table of `path`; a tensor of a type outside IMPORTED_TYPES is refused."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as err:  # the reader raises ValueError, struct errors and others on a bad file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    tensors = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in IMPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {tensor.name} has type {type_name}, which mxc does not import; "
                            f"mxc imports {', '.join(IMPORTED_TYPES)}")
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        tensors[tensor.name] = GGUFTensor(tensor.name, type_name, shape, tensor.data)
    return GGUFFile(path, metadata, tensors)
