"""What one parameter is (shape, logical axes, initialiser) and the small builders layer kinds
use to state theirs. Plain Python, no JAX: the planner and the analysis read definitions too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mxc.spec.ir import LayerNorm, RMSNorm


class UnsupportedError(ValueError):
    """The IR asks for something this lowering does not build."""


@dataclass(frozen=True)
class ParamDef:
    """One parameter: its shape, a logical axis per dimension, and how it starts."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str  # "normal", "ones" or "zeros"

    def stacked(self, layers: int) -> "ParamDef":
        return ParamDef((layers, *self.shape), ("layers", *self.axes), self.init)


def is_def(x) -> bool:
    return isinstance(x, ParamDef)


def map_defs(fn: Callable[[ParamDef], ParamDef], defs: dict) -> dict:
    """`fn` applied to every ParamDef of a nested dict of definitions."""
    return {k: fn(v) if is_def(v) else map_defs(fn, v) for k, v in defs.items()}


def matrix(shape, axes) -> ParamDef:
    return ParamDef(tuple(shape), tuple(axes), "normal")


def zeros(shape, axes) -> ParamDef:
    return ParamDef(tuple(shape), tuple(axes), "zeros")


def linear(in_shape, in_axes, out_shape, out_axes, bias: bool) -> dict:
    defs = {"kernel": matrix((*in_shape, *out_shape), (*in_axes, *out_axes))}
    if bias:
        defs["bias"] = zeros(out_shape, out_axes)
    return defs


def norm_defs(norm, dim: int, axis: str) -> dict:
    if isinstance(norm, RMSNorm):
        if not norm.scale:
            return {}
        return {"scale": ParamDef((dim,), (axis,), "zeros" if norm.zero_centered else "ones")}
    assert isinstance(norm, LayerNorm)
    defs = {"scale": ParamDef((dim,), (axis,), "ones")}
    if norm.bias:
        defs["bias"] = zeros((dim,), (axis,))
    return defs
