"""Multi-head latent attention (DeepSeek V2/V3): keys and values from one compressed latent per
token; the layout of its parameters and cache is described in mxc.compiler.lower.mla."""

from __future__ import annotations

from mxc.compiler.analysis import norm_params
from mxc.compiler.kinds import register
from mxc.compiler.kinds.base import AttentionKind
from mxc.compiler.lower.param_def import linear, matrix, norm_defs
from mxc.spec.ir import MLA


def mla_defs(att: MLA, d_model: int) -> dict:
    """One layer's MLA parameters (unstacked)."""
    h, qk = att.heads, att.qk_nope_head_dim + att.qk_rope_head_dim
    defs = {}
    if att.q_lora_rank is None:
        defs["q"] = linear((d_model,), ("embed",), (h, qk), ("heads", "head_dim"), False)
    else:
        defs["q_a"] = linear((d_model,), ("embed",), (att.q_lora_rank,), ("q_lora",), att.qkv_bias)
        defs["q_norm"] = norm_defs(att.lora_norm, att.q_lora_rank, "q_lora")
        defs["q_b"] = linear((att.q_lora_rank,), ("q_lora",), (h, qk), ("heads", "head_dim"), False)
    # The fused [latent, k_rope] output is not a kv_lora axis: it would split unlike the cache.
    defs["kv_a"] = linear((d_model,), ("embed",), (att.kv_lora_rank + att.qk_rope_head_dim,), (None,),
                          att.qkv_bias)
    defs["kv_norm"] = norm_defs(att.lora_norm, att.kv_lora_rank, "kv_lora")
    defs["kv_b"] = linear((att.kv_lora_rank,), ("kv_lora",), (h, att.qk_nope_head_dim + att.v_head_dim),
                          ("heads", "head_dim"), False)
    defs["o"] = linear((h, att.v_head_dim), ("heads", "head_dim"), (d_model,), ("embed",), att.out_bias)
    if att.sinks:
        defs["sinks"] = matrix((h,), ("heads",))
    return defs


def latent_cache_entries(att: MLA, batch: int, length: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """One layer's cache arrays, name -> (shape, logical axes): the latent and the rotated rope key."""
    return {"latent": ((batch, length, att.kv_lora_rank), ("batch", "cache_seq", "kv_lora")),
            "k_rope": ((batch, length, att.qk_rope_head_dim), ("batch", "cache_seq", "head_dim"))}


class LatentAttention(AttentionKind):
    ir_classes = (MLA,)

    def check(self, att, at, report):
        for field in ("window", "chunk"):
            if getattr(att, field) is not None:
                report(at + (field,), f"mla attention has no {field}: DeepSeek's latent attention "
                                      "attends to the whole causal prefix")
        for field in ("qk_norm", "temperature_tuning"):
            # The absorbed form never builds per-head keys, so nothing could normalise or rescale them.
            if getattr(att, field) is not None:
                report(at + (field,), f"mla attention takes no {field}: its keys exist only as "
                                      "the shared latent")

    def param_defs(self, att, d_model):
        return mla_defs(att, d_model)

    def param_counts(self, att, d_model):
        qkv, out = self.projection_weights(att, d_model)
        q_norm = 0 if att.q_lora_rank is None else norm_params(att.lora_norm, att.q_lora_rank)
        extra = q_norm + norm_params(att.lora_norm, att.kv_lora_rank)
        if att.qkv_bias:
            # DeepSeek's attention_bias: on the down-projections q_a (when low-rank) and kv_a only.
            extra += (att.q_lora_rank or 0) + att.kv_lora_rank + att.qk_rope_head_dim
        if att.out_bias:
            extra += d_model
        extra += att.heads if att.sinks else 0
        return qkv + out + extra, qkv + out

    def projection_weights(self, att, d_model):
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        if att.q_lora_rank is None:
            q = d_model * att.heads * qk
        else:
            q = d_model * att.q_lora_rank + att.q_lora_rank * att.heads * qk
        kv = (d_model * (att.kv_lora_rank + att.qk_rope_head_dim)
              + att.kv_lora_rank * att.heads * (att.qk_nope_head_dim + att.v_head_dim))
        return q + kv, att.heads * att.v_head_dim * d_model

    def value_head_dim(self, att):
        return att.v_head_dim

    def cache_entries(self, att, batch, length):
        return latent_cache_entries(att, batch, length)

    def apply(self, att, params, x, positions, **cache):
        from mxc.compiler.lower.mla import mla_layer

        return mla_layer(att, params, x, positions, **cache)


LATENT_ATTENTION = register(LatentAttention())
