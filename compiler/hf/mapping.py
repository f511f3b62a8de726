"""HF tensor names <-> mxc parameter paths, with the reshapes between their layouts.

HF stores a linear layer as weight [out, in] with heads flattened; mxc keeps kernel [in, out]
with heads split out (see mxc.compiler.lower.params). Both rotate queries and keys by halves, so
no rotary permutation is needed. Every conversion is a transpose, reshape or slice: import and
export are exact inverses.

A TensorMap ties one HF tensor to one mxc parameter (or one layer's, or one expert's, slice of
it); a FusedTensorMap one HF tensor to several (GPT-OSS's and Llama 4's fused gate_up_proj).
Families beyond the Llama layout have their own modules, found through `families`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from mxc.compiler.lower.params import LayerSlot, layer_slots
from mxc.spec.ir import GLU, MLA, RMSNorm, ModelSpec

Convert = Callable[[np.ndarray], np.ndarray]


class LayoutError(ValueError):
    """The spec has a part with no HF counterpart in the families mxc converts."""


class ShapeMismatch(ValueError):
    """A checkpoint tensor's shape does not fit the parameter the spec gives it."""


def _slot(params, path: tuple, index):
    leaf = get_path(params, path)
    return leaf if index is None else leaf[index]


@dataclass(frozen=True)
class TensorMap:
    hf_name: str
    path: tuple  # keys into the parameter tree
    # Index into the leaf: the stacked "layers" position, (layer, expert) for one expert's slice
    # of a stacked expert tensor, None for unstacked parameters.
    layer: int | tuple | None
    to_mxc: Convert
    to_hf: Convert

    def write(self, params, tensor: np.ndarray) -> None:
        """Place the HF tensor in `params` (numpy arrays, modified in place)."""
        target = _slot(params, self.path, self.layer)
        value = self.to_mxc(tensor)
        if value.shape != target.shape:
            raise ShapeMismatch(f"{self.hf_name}: shape {list(tensor.shape)} does not fit the spec "
                                f"(wants {list(self.to_hf(target).shape)})")
        target[...] = value.astype(target.dtype)

    def read(self, params) -> np.ndarray:
        """The HF tensor from `params`."""
        return self.to_hf(np.asarray(_slot(params, self.path, self.layer)))


@dataclass(frozen=True)
class FusedTensorMap:
    """One HF tensor that holds several mxc parameters side by side."""

    hf_name: str
    paths: tuple[tuple, ...]
    layer: int | tuple | None
    to_mxc: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # the parts, in the order of `paths`
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray]

    def write(self, params, tensor: np.ndarray) -> None:
        targets = [_slot(params, path, self.layer) for path in self.paths]
        values = self.to_mxc(tensor)
        if [v.shape for v in values] != [t.shape for t in targets]:
            raise ShapeMismatch(f"{self.hf_name}: shape {list(tensor.shape)} does not fit the spec "
                                f"(wants {list(self.to_hf(tuple(targets)).shape)})")
        for target, value in zip(targets, values):
            target[...] = value.astype(target.dtype)

    def read(self, params) -> np.ndarray:
        return self.to_hf(tuple(np.asarray(_slot(params, path, self.layer)) for path in self.paths))


def _same(x):
    return x


def _transpose(x):
    return x.T


def _heads_in(heads: int, head_dim: int) -> tuple[Convert, Convert]:
    # HF [heads * head_dim, embed] <-> mxc [embed, heads, head_dim]
    return (lambda w: w.T.reshape(w.shape[1], heads, head_dim),
            lambda k: k.reshape(k.shape[0], heads * head_dim).T)


def _heads_out(heads: int, head_dim: int) -> tuple[Convert, Convert]:
    # HF [embed, heads * head_dim] <-> mxc [heads, head_dim, embed]
    return (lambda w: w.T.reshape(heads, head_dim, w.shape[0]),
            lambda k: k.reshape(heads * head_dim, k.shape[-1]).T)


def _heads_bias(heads: int, head_dim: int) -> tuple[Convert, Convert]:
    return (lambda b: b.reshape(heads, head_dim), lambda b: b.reshape(heads * head_dim))


def _check_norm(norm, where: str) -> None:
    if not isinstance(norm, RMSNorm) or not norm.scale:
        raise LayoutError(f"{where}: the HF families mxc converts use RMSNorm with a scale")


def tensor_maps(spec: ModelSpec, model_type: str | None = None) -> Iterator[TensorMap | FusedTensorMap]:
    """Every HF tensor of `spec`: in the Llama-family layout (Llama, Mistral, Qwen2/3, Gemma 1/2/3),
    or in its own family's (see families). A checkpoint's config.json model_type, where known,
    names the family a spec alone may not show (a Phi-3 without LongRoPE reads as a Llama)."""
    from mxc.compiler.hf.families import converter_for_model_type, converter_for_spec

    converter = converter_for_model_type(model_type) or converter_for_spec(spec)
    if converter is not None:
        yield from converter.tensor_maps(spec)
        return
    yield from top_level_maps(spec)
    for slot in layer_slots(spec):
        block = spec.blocks[slot.block]
        att, ffn = block.attention, block.mlp
        if isinstance(att, MLA) or not isinstance(ffn, GLU):
            raise LayoutError(f"block '{slot.block}': HF conversion covers mha/gqa/mqa attention with a "
                              f"glu feed-forward, not {att.kind} with {ffn.kind}")
        if att.sinks or att.chunk is not None or att.temperature_tuning is not None:
            raise LayoutError(f"block '{slot.block}': sinks, chunked attention and temperature tuning have no "
                              "counterpart in the HF families mxc converts")
        if att.qk_norm is not None:
            _check_norm(att.qk_norm, f"block '{slot.block}' qk_norm")
        entry = layer_entry(slot)
        yield from norm_maps(entry, block, slot.block)
        yield from attention_maps(entry, att, slot.block)
        for proj in ("gate", "up", "down"):
            yield entry(f"mlp.{proj}_proj.weight", ("mlp", proj, "kernel"), (_transpose, _transpose))
            if ffn.bias:
                yield entry(f"mlp.{proj}_proj.bias", ("mlp", proj, "bias"))


def top_level_maps(spec: ModelSpec) -> Iterator[TensorMap]:
    """Embedding, final norm and (untied) output head."""
    _check_norm(spec.final_norm, "final_norm")
    yield TensorMap("model.embed_tokens.weight", ("embed", "embedding"), None, _same, _same)
    yield TensorMap("model.norm.weight", ("final_norm", "scale"), None, _same, _same)
    if not spec.embedding.tied:
        yield TensorMap("lm_head.weight", ("head", "kernel"), None, _transpose, _transpose)


def layer_entry(slot: LayerSlot) -> Callable[..., TensorMap]:
    """entry(hf name under model.layers.N., mxc path under the layer, (to_mxc, to_hf)) for one layer."""
    hf = f"model.layers.{slot.index}."
    base = ("segments", slot.segment, slot.position)

    def entry(name, path, convert=(_same, _same), index: tuple = ()):
        # `index` goes past the layer into the leaf: (expert,) for one expert's slice.
        layer = (slot.repeat, *index) if index else slot.repeat
        return TensorMap(hf + name, base + path, layer, convert[0], convert[1])

    entry.hf_prefix = hf
    entry.base = base
    entry.repeat = slot.repeat
    return entry


def norm_maps(entry, block, where: str) -> Iterator[TensorMap]:
    """The layer's norms: input_layernorm and post_attention_layernorm (and Gemma 2/3's extra two)."""
    _check_norm(block.norm, f"block '{where}' norm")
    yield entry("input_layernorm.weight", ("attention_norm", "scale"))
    if block.post_norm is not None:
        # Gemma 2/3: post_attention_layernorm really follows attention; the pre-MLP norm has its own name.
        _check_norm(block.post_norm, f"block '{where}' post_norm")
        yield entry("post_attention_layernorm.weight", ("attention_post_norm", "scale"))
        yield entry("pre_feedforward_layernorm.weight", ("mlp_norm", "scale"))
        yield entry("post_feedforward_layernorm.weight", ("mlp_post_norm", "scale"))
    else:
        # Llama's post_attention_layernorm is the norm before the MLP.
        yield entry("post_attention_layernorm.weight", ("mlp_norm", "scale"))


def attention_maps(entry, att, where: str) -> Iterator[TensorMap]:
    """self_attn's q, k, v, o projections with their biases, QK-norm scales (a scale-free norm
    has none) and GPT-OSS's sinks."""
    for proj, heads in (("q", att.heads), ("k", att.kv_heads), ("v", att.kv_heads)):
        yield entry(f"self_attn.{proj}_proj.weight", ("attention", proj, "kernel"),
                    _heads_in(heads, att.head_dim))
        if att.qkv_bias:
            yield entry(f"self_attn.{proj}_proj.bias", ("attention", proj, "bias"),
                        _heads_bias(heads, att.head_dim))
    yield entry("self_attn.o_proj.weight", ("attention", "o", "kernel"), _heads_out(att.heads, att.head_dim))
    if att.out_bias:
        yield entry("self_attn.o_proj.bias", ("attention", "o", "bias"))
    if att.qk_norm is not None and not (isinstance(att.qk_norm, RMSNorm) and not att.qk_norm.scale):
        _check_norm(att.qk_norm, f"block '{where}' qk_norm")
        yield entry("self_attn.q_norm.weight", ("attention", "q_norm", "scale"))
        yield entry("self_attn.k_norm.weight", ("attention", "k_norm", "scale"))
    if att.sinks:
        yield entry("self_attn.sinks", ("attention", "sinks"))


def get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree
