"""Multi-head latent attention (DeepSeek V2/V3; arXiv:2405.04434, section 2.1).

Keys and values come from one compressed latent per token, c = norm(x·kv_a) [kv_lora_rank],
expanded per head by k_b (the keys' position-free part) and v_b (the values). Position enters
through a small extra key, k_rope [qk_rope_head_dim], shared by every head, and the last
qk_rope_head_dim numbers of each query head ("decoupled RoPE"). The query has its own low-rank
bottleneck, q = norm(x·q_a)·q_b, or one full-rank projection when q_lora_rank is none (V2-Lite).

The same attention is computed in one of two forms:
    expanded   k = [c·k_b, k_rope] and v = c·v_b for every head, then multi-head attention.
               Used without a cache (training, a plain forward pass).
    absorbed   k_b folded into the query (q_nope·k_bᵀ lives in latent space) and v_b into the
               output, so attention runs as multi-query attention straight over [c, k_rope]:
               decoding never expands the cache. DeepSeek's reference inference code ("absorb")
               does the same; used whenever a cache is given (prefill and decode).
Both go through the one attention core, with a value size that differs from the key size.
The KV cache holds, per token and layer, c and the rotated k_rope: kv_lora_rank +
qk_rope_head_dim numbers, whatever the number of heads.

Parameters (kernels [in, out] with heads split out, as elsewhere in the layer library):
    q {kernel [embed, heads, qk]}                  when q_lora_rank is none, else
    q_a {kernel [embed, q_lora], bias}, q_norm {scale [q_lora]}, q_b {kernel [q_lora, heads, qk]}
    kv_a {kernel [embed, kv_lora + rope], bias}, kv_norm {scale [kv_lora]}
    kv_b {kernel [kv_lora, heads, nope + v]}
    o {kernel [heads, v, embed], bias}, sinks [heads]
where qk = nope + rope; the biases exist with qkv_bias (HF's attention_bias: the reference puts
none on q_b, kv_b or a full-rank q) and out_bias. kv_a holds the latent's projection and then
k_rope's, kv_b the keys' expansion k_b and then the values' v_b, fused as in the reference
checkpoints (kv_a_proj_with_mqa, kv_b_proj): one matmul each, cut apart after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.norms import apply_norm
from mxc.compiler.lower.projection import project, weight
from mxc.compiler.lower.remat import CONTEXT, named_residual
from mxc.compiler.lower.rope import apply_rope, rope_angles, softmax_scale_correction
from mxc.compiler.lower.sharding import RESIDUAL_AXES, constrain
from mxc.spec.ir import MLA


def _project(x, params, dtype, pattern):
    return project(x, params, pattern, dtype)


def _query(att: MLA, params: dict, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    if att.q_lora_rank is None:
        return _project(x, params["q"], dtype, "bse,ehd->bshd")
    compressed = apply_norm(att.lora_norm, params["q_norm"], _project(x, params["q_a"], dtype, "bse,ec->bsc"))
    return _project(compressed, params["q_b"], dtype, "bsc,chd->bshd")


def _expansions(att: MLA, params: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """k_b [kv_lora, heads, nope] and v_b [kv_lora, heads, v], cut from the fused kv_b."""
    kv_b = weight(params["kv_b"], dtype)
    return kv_b[..., :att.qk_nope_head_dim], kv_b[..., att.qk_nope_head_dim:]


def _expanded(att, params, q_nope, q_rope, latent, k_rope, dtype, **core):
    """Multi-head attention over keys and values expanded from the latent, per head."""
    k_b, v_b = _expansions(att, params, dtype)
    k_nope = jnp.einsum("btc,chd->bthd", latent, k_b)
    v = jnp.einsum("btc,chd->bthd", latent, v_b)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))],
                        axis=-1)
    k = checkpoint_name(constrain(k, ("batch", "seq", "kv_heads", "head_dim")), "key_proj")
    v = checkpoint_name(constrain(v, ("batch", "seq", "kv_heads", "head_dim")), "value_proj")
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    return attend(q, k, v, **core)


def _absorbed(att, params, q_nope, q_rope, latent, k_rope, dtype, **core):
    """The same attention with k_b folded into the query and v_b applied after the core: one shared
    key [latent, k_rope] and one shared value (the latent) for all heads, i.e. multi-query attention."""
    k_b, v_b = _expansions(att, params, dtype)
    q_latent = jnp.einsum("bshd,chd->bshc", q_nope, k_b)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)
    k = jnp.concatenate([latent, k_rope], axis=-1)[:, :, None, :]
    context = attend(q, k, latent[:, :, None, :], **core)
    return jnp.einsum("bshc,chd->bshd", context, v_b)


def mla_layer(att: MLA, params: dict, x: jax.Array, positions: jax.Array, *, cache: dict | None = None,
              cache_index: jax.Array | None = None, cache_positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None, impl: str = "xla",
              absorb: bool | None = None) -> tuple[jax.Array, dict | None]:
    """x [batch, seq, embed] at positions [batch, seq] -> ([batch, seq, embed], updated cache slice).

    With a cache ({"latent": [batch, cache_seq, kv_lora], "k_rope": [batch, cache_seq, rope]}) this
    step's latents are written at cache_index and the queries attend to every slot, visible by
    cache_positions (already updated by the caller). segment_ids [batch, seq] keeps a packed
    sequence's documents apart (training; no cache). `absorb` picks the form (default: absorbed
    exactly when there is a cache); both give the same result up to rounding."""
    absorb = cache is not None if absorb is None else absorb
    dtype = x.dtype
    q = checkpoint_name(constrain(_query(att, params, x), ("batch", "seq", "heads", "head_dim")), "query_proj")
    q_nope, q_rope = q[..., :att.qk_nope_head_dim], q[..., att.qk_nope_head_dim:]
    compressed = _project(x, params["kv_a"], dtype, "bse,ec->bsc")
    latent = apply_norm(att.lora_norm, params["kv_norm"], compressed[..., :att.kv_lora_rank])
    latent = constrain(latent, ("batch", "seq", "kv_lora"))
    k_rope = compressed[..., att.kv_lora_rank:]
    if att.rope is not None:
        cos, sin = rope_angles(att.rope, att.qk_rope_head_dim, positions)
        q_rope = apply_rope(q_rope, cos, sin, att.rope.interleaved)
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, att.rope.interleaved)[:, :, 0, :]

    new_cache = None
    kv_positions = positions
    if cache is not None:
        latent = jax.lax.dynamic_update_slice(cache["latent"], latent.astype(cache["latent"].dtype),
                                              (0, cache_index, 0))
        k_rope = jax.lax.dynamic_update_slice(cache["k_rope"], k_rope.astype(cache["k_rope"].dtype),
                                              (0, cache_index, 0))
        latent = constrain(latent, ("batch", "cache_seq", "kv_lora"))
        k_rope = constrain(k_rope, ("batch", "cache_seq", "head_dim"))
        new_cache = {"latent": latent, "k_rope": k_rope}
        kv_positions = cache_positions
        latent, k_rope = latent.astype(dtype), k_rope.astype(dtype)

    scalar = att.query_pre_attn_scalar if att.query_pre_attn_scalar is not None else att.head_dim
    core = dict(q_positions=positions, kv_positions=kv_positions,
                scale=scalar ** -0.5 * softmax_scale_correction(att.rope), softcap=att.softcap,
                sinks=params.get("sinks"), segment_ids=segment_ids, impl=impl)
    form = _absorbed if absorb else _expanded
    context = checkpoint_name(form(att, params, q_nope, q_rope, latent, k_rope, dtype, **core), CONTEXT)
    out = _project(context, params["o"], dtype, "bshd,hde->bse")
    out = named_residual(constrain(out, RESIDUAL_AXES), "out_proj")
    return out, new_cache
