"""The attention layer (MHA, GQA, MQA): projections, QK-norm, RoPE, the KV cache, the core, output.
MLA layers have their own (mla.py); each kind's apply is bound in mxc.compiler.kinds.

The same function serves training (no cache) and inference (a cache slice per layer); only
where the keys come from differs. Intermediates a remat policy may keep are named with
`checkpoint_name`: query_proj, key_proj, value_proj, context (the core's output) and
out_proj (after the output projection).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.lower.attention_blocks import self_attention_impl
from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project, project_split
from mxc.compiler.lower.remat import CONTEXT, named_residual  # its word is also a mesh axis's name: one spelling
from mxc.compiler.quant import kv_cache
from mxc.compiler.lower.rope import apply_rope, rope_angles
from mxc.compiler.lower.sharding import RESIDUAL_AXES, constrain
from mxc.compiler.lower.stacking import heads_unsplit, project_joined, project_pair, stacked_projections

CHECKPOINT_NAMES = ("query_proj", "key_proj", "value_proj", CONTEXT, "out_proj")


def _project(x, params, dtype, pattern):
    return project(x, params, pattern, dtype)


def _temperature(tuning, positions):
    # Llama 4 sharpens attention on its NoPE layers as the query's position grows.
    scale = jnp.log(jnp.floor((positions.astype(jnp.float32) + 1.0) / tuning.floor_scale) + 1.0)
    return 1.0 + tuning.attn_scale * scale


def attention_layer(att, params: dict, x: jax.Array, positions: jax.Array, *, cache: dict | None = None,
                    cache_index: jax.Array | None = None, cache_positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, image_blocks: jax.Array | None = None,
                    impl: str = "xla") -> tuple[jax.Array, dict | None]:
    """x [batch, seq, embed] at positions [batch, seq] -> ([batch, seq, embed], updated cache slice).
    segment_ids [batch, seq] keeps a packed sequence's documents apart (training; no cache).

    With a cache ({"k", "v"}: [batch, cache_seq, kv_heads, head_dim]) the new keys and values are
    written at cache_index and the query attends to every slot, visible by cache_positions (which
    the caller has already updated with `positions`).
    image_blocks [batch, seq]: each token's image (-1 for text), attended both ways (attend)."""
    dtype = x.dtype
    if "qkv" in params:  # CPU serving: the kernels joined once, at conversion (layer_layout.py)
        q, k, v = project_split(x, params["qkv"], "bse,ehd->bshd", dtype, (att.heads, att.kv_heads, att.kv_heads), 2)
    elif not stacked_projections():
        q, k, v = (_project(x, params[name], dtype, "bse,ehd->bshd") for name in ("q", "k", "v"))
    elif heads_unsplit():
        q, k, v = project_joined(x, [params["q"], params["k"], params["v"]], dtype, "bse,ehd->bshd")
    else:
        q = _project(x, params["q"], dtype, "bse,ehd->bshd")
        k, v = project_pair(x, params["k"], params["v"], dtype, "bse,ekhd->kbshd")
    q = checkpoint_name(constrain(q, ("batch", "seq", "heads", "head_dim")), "query_proj")
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "key_proj")
    v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "head_dim")), "value_proj")
    if att.qk_norm is not None:
        q = apply_norm(att.qk_norm, params["q_norm"], q)
        k = apply_norm(att.qk_norm, params["k_norm"], k)
    if att.rope is not None:
        cos, sin = rope_angles(att.rope, att.head_dim, positions)
        q = apply_rope(q, cos, sin, att.rope.interleaved)
        k = apply_rope(k, cos, sin, att.rope.interleaved)
    if att.temperature_tuning is not None:
        q = (q * _temperature(att.temperature_tuning, positions)[:, :, None, None]).astype(dtype)

    new_cache = None
    kv_positions = positions
    kv_blocks = image_blocks
    if cache is not None:
        new_cache = kv_cache.written(cache, {"k": k, "v": v}, cache_index)  # int8 caches quantize here
        kv_positions = cache_positions
        if image_blocks is not None:  # the cache's other slots hold text (or nothing)
            kv_blocks = jax.lax.dynamic_update_slice(jnp.full(cache_positions.shape, -1, jnp.int32),
                                                     image_blocks.astype(jnp.int32), (0, cache_index))
        k, v = kv_cache.read(new_cache, "k", dtype), kv_cache.read(new_cache, "v", dtype)

    scalar = att.query_pre_attn_scalar if att.query_pre_attn_scalar is not None else att.head_dim
    context = attend(q, k, v, q_positions=positions, kv_positions=kv_positions, scale=scalar ** -0.5,
                     window=att.window, chunk=att.chunk, softcap=att.softcap,
                     sinks=params.get("sinks"), segment_ids=segment_ids,
                     image_blocks=None if image_blocks is None else (image_blocks, kv_blocks),
                     impl=self_attention_impl(impl, cached=cache is not None, image_blocks=image_blocks))
    context = checkpoint_name(context, CONTEXT)
    out = _project(context, params["o"], dtype, "bshd,hde->bse")
    out = named_residual(constrain(out, RESIDUAL_AXES), "out_proj")
    return out, new_cache
