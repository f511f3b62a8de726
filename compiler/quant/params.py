"""Which parameters a configuration quantizes, and the quantized parameter tree.

The projection kernels of the layers are quantized (attention's q/k/v/o, MLA's projections, the
dense and expert feed-forward matrices), and so are the embedding table (one scale per token's
row, which serves the lookup and the tied output head alike) and the output head; norms, biases,
the MoE router (its top-k is sensitive to small changes) and DeepSeek's multi-token-prediction
modules stay as they are. `int4-mlp` quantizes only the kernels under a layer's "mlp".

A quantized weight's dict holds "kernel" (or "embedding": int8, int4 or float8 values, the
weight's shape) beside "kernel_scale" ("embedding_scale": float32, the same rank, 1 along the
contracting axes, or int4's groups along the last of them; runtime/quant_arrays.py); `bf16`
holds the weight in bfloat16 and no scale.

The contracting axes follow from the kernel's logical axes (compiler/lower/params.py): leading
"layers" and "experts" axes are stacks, a kernel whose last axis is "embed" maps everything
before it to the model dimension (attention's o, the down projections), any other maps its first
axis (the model dimension, a LoRA rank, the hidden units) to the rest. The lowering's einsums
contract exactly these (compiler/lower/projection.py checks it when tracing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mxc.compiler.quant.config import QuantConfig
from mxc.runtime import quant_arrays

STACK_AXES = ("layers", "experts")
SCALE_SUFFIX = "_scale"
SCALE = "kernel" + SCALE_SUFFIX


def contracting_axes(axes: tuple) -> tuple[int, ...]:
    """The contracting axes (indices into `axes`) of a kernel with these logical axes."""
    if tuple(axes) == ("vocab", "embed"):  # the embedding, as the tied output head uses it
        return (1,)
    first = 0
    while first < len(axes) and axes[first] in STACK_AXES:
        first += 1
    core = range(first, len(axes))
    if len(core) > 1 and axes[-1] == "embed":
        return tuple(core)[:-1]
    return (first,)


def _quantized_here(path: tuple, config: QuantConfig) -> bool:
    """Whether the kernel at `path` (its parent's keys) is one `config` quantizes."""
    if not config.quantizes_weights or not path or "router" in path:
        return False
    if path[0] in ("embed", "head"):
        return config.scope == "all"
    return path[0] == "segments" and (config.scope == "all" or "mlp" in path)


def kernels(spec, config: QuantConfig) -> dict[tuple, tuple]:
    """{(path of the parent dict, leaf name): the leaf's logical axes} of every weight quantized."""
    from mxc.compiler.lower.params import param_axes

    found = {}

    def walk(tree, path):
        if isinstance(tree, dict):
            for key, value in tree.items():
                if key in ("kernel", "embedding") and isinstance(value, tuple):
                    if _quantized_here(path, config):
                        found[(path, key)] = value
                elif not isinstance(value, tuple):
                    walk(value, path + (key,))
        elif isinstance(tree, list):
            for index, value in enumerate(tree):
                walk(value, path + (index,))

    walk(param_axes(spec), ())
    return found


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _replaced(tree, path, value):
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(tree, list):
        return [_replaced(item, rest, value) if i == key else item for i, item in enumerate(tree)]
    return {**tree, key: _replaced(tree[key], rest, value)}


def scale_shape(config: QuantConfig, shape: tuple, axes: tuple) -> tuple[int, ...]:
    return quant_arrays.scale_shape(tuple(shape), contracting_axes(axes), config.group_size)


def quantize_kernel(config: QuantConfig, parent: dict, name: str, axes: tuple) -> dict:
    """One weight's parent dict with weight `name` quantized (bias and the rest kept)."""
    kernel = parent[name]
    if config.weights == "bf16":
        return {**parent, name: kernel.astype(jnp.bfloat16)}
    values, scale = quant_arrays.quantize(kernel, config.weights, scale_shape(config, kernel.shape, axes))
    return {**parent, name: values, name + SCALE_SUFFIX: scale}


def quantize_params(spec, params: dict, config: QuantConfig) -> dict:
    """The parameter tree with every weight `config` quantizes quantized (jittable)."""
    for (path, name), axes in kernels(spec, config).items():
        params = _replaced(params, path, quantize_kernel(config, _get(params, path), name, axes))
    return params


def quantized_shapes(spec, config: QuantConfig, shapes: dict, shardings: dict | None = None):
    """ShapeDtypeStructs of quantize_params' result, and with `shardings` (NamedShardings of the
    float tree) theirs: a scale keeps its weight's sharding on the axes it keeps whole and is
    replicated along the ones it reduces or groups."""
    quantized = jax.eval_shape(lambda p: quantize_params(spec, p, config), shapes)
    if shardings is None:
        return quantized
    for (path, name) in kernels(spec, config):
        parent = dict(_get(shardings, path))
        scale = _get(quantized, path).get(name + SCALE_SUFFIX)
        if scale is not None:
            weight_sharding = parent[name]
            weight_shape = _get(quantized, path)[name].shape
            entries = tuple(weight_sharding.spec) + (None,) * (len(weight_shape) - len(weight_sharding.spec))
            kept = tuple(entry if n == k else None for entry, n, k in zip(entries, scale.shape, weight_shape))
            parent[name + SCALE_SUFFIX] = NamedSharding(weight_sharding.mesh, PartitionSpec(*kept))
        shardings = _replaced(shardings, path, parent)
    return quantized, shardings


def serving_params(spec, shapes: dict, shardings: dict):
    """The parameters a serving function of `spec` takes (shapes and shardings): quantized as its
    `quantize` configuration says, or the float ones."""
    from mxc.compiler.quant.config import parse

    config = parse(spec.quantize or "fp32")
    if not config.quantizes_weights:
        return shapes, shardings
    return quantized_shapes(spec, config, shapes, shardings)
