"""A float parameter checkpoint loaded into a quantized artifact: read the float kernels, quantize
them as the artifact's parameters ask, in pure jax.numpy (no compiler), and place them.

What to do is read off the target tree alone: a dict whose target holds "NAME_scale" beside
"NAME" (kernel, embedding) wants NAME quantized to the target's dtype (int8, int4,
float8_e4m3fn) with scales of the target scale's shape (runtime/quant_arrays.py); a float leaf
whose target is bfloat16 where the checkpoint holds another float type is cast. Everything else
loads as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mxc.runtime import quant_arrays

SCALE_SUFFIX = "_scale"  # "kernel_scale" beside "kernel", "embedding_scale" beside "embedding"
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def _leaf_dtypes(tree) -> dict[str, str]:
    return {jax.tree_util.keystr(path): str(leaf.dtype)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _scaled(tree: dict) -> list[str]:
    """The names in a dict that have a scale beside them."""
    return [k for k in tree if k + SCALE_SUFFIX in tree]


def needs_quantizing(saved, target) -> bool:
    """Whether `target` wants quantized (or bfloat16) weights that the checkpoint `saved` (its
    metadata tree) holds in another float type."""
    saved_dtypes = _leaf_dtypes(saved)
    for name, dtype in _leaf_dtypes(target).items():
        if name.endswith(f"{SCALE_SUFFIX}']") and name not in saved_dtypes:
            return True
        if dtype == "bfloat16" and saved_dtypes.get(name, dtype) in FLOAT_DTYPES and saved_dtypes.get(name) != dtype:
            return True
    return False


def float_target(saved, target):
    """`target` without the scales, each quantized or cast leaf in the checkpoint's float dtype."""
    saved_dtypes = _leaf_dtypes(saved)

    def walk(tree, path):
        if isinstance(tree, dict):
            scaled = _scaled(tree)
            return {k: walk(v, path + (jax.tree_util.DictKey(k),)) for k, v in tree.items()
                    if not _is_scale(k, scaled)}
        if isinstance(tree, (list, tuple)):
            return type(tree)(walk(v, path + (jax.tree_util.SequenceKey(i),)) for i, v in enumerate(tree))
        have = saved_dtypes.get(jax.tree_util.keystr(path))
        if have is not None and have != str(tree.dtype) and have in FLOAT_DTYPES:
            return jax.ShapeDtypeStruct(tree.shape, np.dtype(have), sharding=getattr(tree, "sharding", None))
        return tree

    return walk(target, ())


def quantized_like(floats, target):
    """The float tree read against float_target(target), quantized and placed as `target` says."""
    if isinstance(target, dict):
        scaled = _scaled(target)
        out = {k: quantized_like(floats[k], v) for k, v in target.items() if k not in scaled and not _is_scale(k, scaled)}
        for name in scaled:
            values, scale = target[name], target[name + SCALE_SUFFIX]
            kind = quant_arrays.kind_of_dtype(values.dtype)
            quantized = jax.jit(lambda w, kind=kind, shape=tuple(scale.shape): quant_arrays.quantize(w, kind, shape))(
                floats[name])
            out[name], out[name + SCALE_SUFFIX] = (_placed(array, like) for array, like in zip(quantized, (values, scale)))
        return out
    if isinstance(target, (list, tuple)):
        return type(target)(quantized_like(f, t) for f, t in zip(floats, target))
    if floats.dtype != target.dtype:  # a bfloat16 weight from a float32 checkpoint
        return _placed(floats.astype(jnp.dtype(target.dtype)), target)
    return floats


def _is_scale(key: str, scaled: list[str]) -> bool:
    return key.endswith(SCALE_SUFFIX) and key[:-len(SCALE_SUFFIX)] in scaled


def _placed(array, like):
    sharding = getattr(like, "sharding", None)
    return array if sharding is None else jax.device_put(array, sharding)
