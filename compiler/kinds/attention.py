"""Multi-head attention with per-head keys and values: MHA, GQA (kv_heads groups) and MQA (one)."""

from __future__ import annotations

from mxc.compiler.analysis import norm_params
from mxc.compiler.kinds import register
from mxc.compiler.kinds.base import AttentionKind
from mxc.compiler.lower.param_def import linear, matrix, norm_defs
from mxc.spec.ir import GQA, MHA, MQA

CACHE_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


class HeadAttention(AttentionKind):
    ir_classes = (MHA, GQA, MQA)

    def check(self, att, at, report):
        if att.heads % att.kv_heads:
            report(at + ("kv_heads",), f"heads ({att.heads}) is not divisible by kv_heads ({att.kv_heads})",
                   "every key/value head must serve the same number of query heads")

    def param_defs(self, att, d_model):
        h, kv, hd = att.heads, att.kv_heads, att.head_dim
        defs = {
            "q": linear((d_model,), ("embed",), (h, hd), ("heads", "head_dim"), att.qkv_bias),
            "k": linear((d_model,), ("embed",), (kv, hd), ("kv_heads", "head_dim"), att.qkv_bias),
            "v": linear((d_model,), ("embed",), (kv, hd), ("kv_heads", "head_dim"), att.qkv_bias),
            "o": linear((h, hd), ("heads", "head_dim"), (d_model,), ("embed",), att.out_bias),
        }
        if att.qk_norm is not None:
            defs["q_norm"] = norm_defs(att.qk_norm, hd, "head_dim")
            defs["k_norm"] = norm_defs(att.qk_norm, hd, "head_dim")
        if att.sinks:
            defs["sinks"] = matrix((h,), ("heads",))
        return defs

    def param_counts(self, att, d_model):
        qkv, out = self.projection_weights(att, d_model)
        q_dim = att.heads * att.head_dim
        kv_dim = att.kv_heads * att.head_dim
        extra = (q_dim + 2 * kv_dim) if att.qkv_bias else 0
        extra += d_model if att.out_bias else 0
        extra += 2 * norm_params(att.qk_norm, att.head_dim)
        extra += att.heads if att.sinks else 0
        return qkv + out + extra, qkv + out

    def projection_weights(self, att, d_model):
        return d_model * (att.heads + 2 * att.kv_heads) * att.head_dim, att.heads * att.head_dim * d_model

    def value_head_dim(self, att):
        return att.head_dim

    def cache_entries(self, att, batch, length):
        shape = (batch, length, att.kv_heads, att.head_dim)
        return {"k": (shape, CACHE_AXES), "v": (shape, CACHE_AXES)}

    def apply(self, att, params, x, positions, **cache):
        from mxc.compiler.lower.attention import attention_layer

        return attention_layer(att, params, x, positions, **cache)


HEAD_ATTENTION = register(HeadAttention())
