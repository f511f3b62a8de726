"""Parameter trees read off the IR: shapes, dtypes, initialisers and logical axes, from one table.

The tree is nested dicts keyed by the IR's names; the layers of a segment are stacked on a leading
"layers" axis so that one `lax.scan` runs them:

    {"embed":      {"embedding": [vocab, embed]},
     "segments":   [                                # one entry per `spec.layers` segment
                     [                              # one entry per block of the segment's period
                       {"attention_norm": {"scale": [layers, embed]},
                        "attention": {"q": {"kernel": [layers, embed, heads, head_dim], "bias": ...},
                                      "k": ..., "v": ..., "o": {"kernel": [layers, heads, head_dim, embed]},
                                      "q_norm": {"scale"}, "k_norm": {"scale"}, "sinks": [layers, heads]},
                        "attention_post_norm": {...},  # Gemma 2/3 only
                        "mlp_norm": {...},            # absent in a parallel block
                        "mlp": {"gate": {"kernel": [layers, embed, mlp]}, "up": ..., "down": ...},
                               # or, for a MoE layer (see kinds/moe.py, moe_defs):
                               # {"router": {"kernel": [layers, embed, experts], "bias", "correction_bias"},
                               #  "experts": {"gate": {"kernel": [layers, experts, embed, mlp]}, ...},
                               #  "shared": {"gate": {"kernel": [layers, embed, mlp]}, ...}}
                        "mlp_post_norm": {...}},       # Gemma 2/3 only
                     ], ...],
     "final_norm": {"scale": [embed]},
     "head":       {"kernel": [embed, vocab]},        # absent when the embedding is tied
     "mtp":        {...},                             # DeepSeek V3's modules, stacked (see mtp.py)
     "vision":     {...}}                             # the vision tower (see kinds/vision.py)

Each layer kind states its own subtree (mxc.compiler.kinds): MLA layers hold their own attention
tree (see mla.py) in place of q/k/v/o.

Norms hold "scale" (and "bias" for a biased LayerNorm) in the stored convention of the reference
(Gemma's zero-centred scale is stored as w, applied as 1 + w), so checkpoints convert without
arithmetic. Linear layers hold "kernel" as [in, out] with heads split out, and "bias" where the IR
asks for one. Initialisers follow the HF reference models: normal(0, init_std) for matrices and
embeddings, ones (zeros when zero-centred) for norm scales, zeros for biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.moe import moe_defs, shared_expert_ffn  # noqa: F401  (the MoE lowering reads them here)
from mxc.compiler.lower.param_def import ParamDef, UnsupportedError, is_def, matrix, norm_defs  # noqa: F401
from mxc.spec.ir import Block, ModelSpec

DEFAULT_INIT_STD = 0.02  # HF's initializer_range default for every family in the zoo


def block_defs(block: Block, d_model: int) -> dict:
    """One layer's parameters (unstacked)."""
    defs = {"attention_norm": norm_defs(block.norm, d_model, "embed"),
            "attention": kind_of(block.attention).param_defs(block.attention, d_model),
            "mlp_norm": norm_defs(block.norm, d_model, "embed"),
            "mlp": kind_of(block.mlp).param_defs(block.mlp, d_model)}
    if block.parallel:  # its feed-forward reads attention_norm's output
        del defs["mlp_norm"]
    if block.post_norm is not None:
        defs["attention_post_norm"] = norm_defs(block.post_norm, d_model, "embed")
        defs["mlp_post_norm"] = norm_defs(block.post_norm, d_model, "embed")
    return defs


def param_defs(spec: ModelSpec) -> dict:
    """The whole model's ParamDef tree (see the module docstring for its layout)."""
    d = spec.d_model
    segments = []
    for seg in spec.layers:
        segments.append([jax.tree.map(lambda p: p.stacked(seg.repeat), block_defs(spec.blocks[name], d),
                                      is_leaf=is_def)
                         for name in seg.period])
    defs = {"embed": {"embedding": matrix((spec.vocab + spec.embedding.extra_rows, d), ("vocab", "embed"))},
            "segments": segments,
            "final_norm": norm_defs(spec.final_norm, d, "embed")}
    if not spec.embedding.tied:
        defs["head"] = {"kernel": matrix((d, spec.vocab), ("embed", "vocab"))}
    if spec.mtp is not None:
        from mxc.compiler.lower.mtp import mtp_defs  # mtp builds on block_defs

        defs["mtp"] = mtp_defs(spec)
    if spec.vision is not None:
        from mxc.compiler.kinds import vision

        defs["vision"] = vision.param_defs(spec)
    return defs


def param_shapes(spec: ModelSpec) -> dict:
    """A pytree of jax.ShapeDtypeStruct in the spec's param_dtype."""
    dtype = jnp.dtype(spec.param_dtype)
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), param_defs(spec), is_leaf=is_def)


def param_axes(spec: ModelSpec) -> dict:
    """The same tree with a tuple of logical axis names per parameter."""
    return jax.tree.map(lambda p: p.axes, param_defs(spec), is_leaf=is_def)


_INITIALISERS: dict[str, Callable] = {
    "normal": lambda key, shape, dtype, std: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
    "ones": lambda key, shape, dtype, std: jnp.ones(shape, dtype),
    "zeros": lambda key, shape, dtype, std: jnp.zeros(shape, dtype),
}


def init_params(spec: ModelSpec, key: jax.Array, init_std: float = DEFAULT_INIT_STD) -> dict:
    """Freshly initialised parameters; pure, so it can be jitted with output shardings."""
    dtype = jnp.dtype(spec.param_dtype)
    leaves, tree = jax.tree.flatten(param_defs(spec), is_leaf=is_def)
    keys = jax.random.split(key, len(leaves))
    values = [_INITIALISERS[p.init](k, p.shape, dtype, init_std) for p, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, values)


@dataclass(frozen=True)
class LayerSlot:
    """Where layer `index` (in model order) lives in the stacked tree."""

    index: int
    segment: int
    position: int  # within the segment's period
    repeat: int  # along the stacked "layers" axis
    block: str


def layer_slots(spec: ModelSpec) -> Iterator[LayerSlot]:
    index = 0
    for s, seg in enumerate(spec.layers):
        for r in range(seg.repeat):
            for p, name in enumerate(seg.period):
                yield LayerSlot(index, s, p, r, name)
                index += 1
