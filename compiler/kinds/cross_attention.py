"""Cross-attention to image features (Llama 3.2 Vision's image layers): queries from the text,
keys and values from the tower's projected tokens, per-head q/k norms, and the block's two tanh
gates (its attention and feed-forward outputs), which live with the attention's parameters.

The keys and values are made once per image at prefill, so a text token goes through the query
and output projections only; the lowering is mxc.compiler.lower.cross_attention.
"""

from __future__ import annotations

from mxc.compiler.analysis import norm_params
from mxc.compiler.kinds import register
from mxc.compiler.kinds.attention import HeadAttention
from mxc.compiler.kinds.base import Intermediate
from mxc.compiler.lower.param_def import zeros
from mxc.spec.ir import CrossAttention, CrossAttentionEntry


class CrossAttentionKind(HeadAttention):
    ir_classes = (CrossAttention,)

    def check(self, att, at, report):
        super().check(att, at, report)
        for field in ("window", "chunk", "softcap", "temperature_tuning", "query_pre_attn_scalar"):
            if getattr(att, field) is not None:
                report(at + (field,), f"cross-attention to an image takes no {field}")
        if att.sinks:
            report(at + ("sinks",), "cross-attention to an image takes no sinks")

    def param_defs(self, att, d_model):
        defs = super().param_defs(att, d_model)  # q, k, v, o and the q/k norms, as self-attention's
        if att.gated:
            # Zero at initialisation (as transformers starts them): a new image layer changes nothing.
            defs["attention_gate"] = zeros((), ())
            defs["mlp_gate"] = zeros((), ())
        return defs

    def param_counts(self, att, d_model):
        q_dim, kv_dim = att.heads * att.head_dim, att.kv_heads * att.head_dim
        weights = d_model * (q_dim + 2 * kv_dim) + q_dim * d_model
        extra = (q_dim + 2 * kv_dim) if att.qkv_bias else 0
        extra += d_model if att.out_bias else 0
        extra += 2 * norm_params(att.qk_norm, att.head_dim) + (2 if att.gated else 0)
        # A text token goes through the query and output projections; keys and values are the image's.
        qkv, out = self.projection_weights(att, d_model)
        return weights + extra, qkv + out

    def projection_weights(self, att, d_model):
        return d_model * att.heads * att.head_dim, att.heads * att.head_dim * d_model

    def value_head_dim(self, att):
        return att.head_dim

    def cache_entries(self, att, batch, length):
        return {}  # the image's keys and values are made from the images at every call

    def attention_intermediates(self, att, choice, images_per_row: int = 1) -> list[Intermediate]:
        """What the layer's attention makes for one microbatch (plan.activations.intermediates
        takes these in place of self-attention's): queries over the text; keys and values over
        each row's image tokens (every tile's, images_per_row images: the compiled batch's default
        is one); the float32 scores [text, image tokens], always materialised whatever attention
        path the text takes (the mask is arbitrary, no flash kernel states it), so they count as
        the xla path's probabilities do (memory.ATTENTION_SCORE_BUFFERS of them in a layer's
        backward, which also covers what XLA's heap adds around them: docs/multimodal.md); the
        context, which the layer does not tag (no policy keeps it by name; its product has batch
        dimensions)."""
        from mxc.compiler.kinds.vision import tokens_per_image

        b, s, act = choice.microbatch, choice.seq, choice.compute_bytes
        images = tokens_per_image(choice.spec.vision) * images_per_row
        text, image = ("batch", "seq"), ("batch", None)
        heads, kv = (att.heads, att.head_dim), (att.kv_heads, att.head_dim)
        return [
            Intermediate("query_proj", (b, s, *heads), (*text, "heads", "head_dim"), act),
            Intermediate("query_normed", (b, s, *heads), (*text, "heads", "head_dim"), act),
            Intermediate("key_proj", (b, images, *kv), (*image, "kv_heads", "head_dim"), act),
            Intermediate("value_proj", (b, images, *kv), (*image, "kv_heads", "head_dim"), act),
            Intermediate("key_normed", (b, images, *kv), (*image, "kv_heads", "head_dim"), act),
            Intermediate("attention_probabilities", (b, att.heads, s, images), ("batch", "heads", "seq", None), 4),
            Intermediate("cross_context", (b, s, *heads), (*text, "heads", "head_dim"), act),
        ]

    def apply(self, att, params, x, positions, **kwargs):
        raise ValueError("a cross_attention layer runs through the model's image path "
                         "(mxc.compiler.lower.cross_attention), not as self-attention")


def check_entry(spec, report) -> None:
    """Cross-attention layers and a tower whose entry is cross_attention come together."""
    crosses = [name for name, block in spec.blocks.items() if isinstance(block.attention, CrossAttention)]
    entry = spec.vision.entry if spec.vision is not None else None
    if crosses and not isinstance(entry, CrossAttentionEntry):
        report(("blocks", crosses[0], "attention"), "a cross_attention layer needs a vision tower whose "
               "entry is cross_attention(...)", "its keys and values are the tower's projected tokens")
    if isinstance(entry, CrossAttentionEntry) and not crosses:
        report(("vision", "entry"), "entry = cross_attention(...) needs cross_attention layers in the text model",
               "add a block whose attention = cross_attention(...) to the layer pattern")


CROSS_ATTENTION = register(CrossAttentionKind())
