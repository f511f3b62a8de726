"""Semantic checks the types alone cannot express; each names the path it is about."""

from __future__ import annotations

from typing import Callable

from mxc.spec.ir import GQA, MLA, ModelSpec, MoE

Report = Callable[..., None]  # report(path, message, hint=None)


def validate(spec: ModelSpec, report: Report) -> None:
    for name, block in spec.blocks.items():
        base = ("blocks", name)
        att = block.attention
        at = base + ("attention",)
        if isinstance(att, GQA) and att.heads % att.kv_heads:
            report(at + ("kv_heads",), f"heads ({att.heads}) is not divisible by kv_heads ({att.kv_heads})",
                   "every key/value head must serve the same number of query heads")
        if isinstance(att, MLA):
            for field in ("window", "chunk"):
                if getattr(att, field) is not None:
                    report(at + (field,), f"mla attention has no {field}: DeepSeek's latent attention "
                                          "attends to the whole causal prefix")
            for field in ("qk_norm", "temperature_tuning"):
                # The absorbed form never builds per-head keys, so nothing could normalise or rescale them.
                if getattr(att, field) is not None:
                    report(at + (field,), f"mla attention takes no {field}: its keys exist only as "
                                          "the shared latent")
        if att.window is not None and att.chunk is not None:
            report(at + ("chunk",), "a layer kind takes a sliding window or chunked attention, not both")
        if att.temperature_tuning is not None and att.rope is not None:
            report(at + ("temperature_tuning",), "temperature tuning applies to NoPE layers only (rope = none)")
        ffn = block.mlp
        if isinstance(ffn, MoE):
            mp = base + ("mlp",)
            r = ffn.router
            if ffn.shared_experts > 1 and ffn.expert.bias:
                report(mp + ("shared_experts",), f"{ffn.shared_experts} shared experts with biases: "
                                                 "their output biases do not fuse into one layer",
                       "use one shared expert, or experts without bias")
            if ffn.top_k > ffn.experts:
                report(mp + ("top_k",), f"top_k ({ffn.top_k}) is larger than experts ({ffn.experts})")
            elif ffn.experts % r.groups:
                report(mp + ("router", "groups"), f"experts ({ffn.experts}) are not divisible into "
                                                  f"{r.groups} groups")
            elif r.top_groups > r.groups:
                report(mp + ("router", "top_groups"), f"top_groups ({r.top_groups}) is larger than "
                                                      f"groups ({r.groups})")
            elif ffn.top_k > r.top_groups * (ffn.experts // r.groups):
                report(mp + ("top_k",), f"top_k ({ffn.top_k}) exceeds the experts in the "
                                        f"{r.top_groups} chosen groups")
    used = set(spec.layer_kinds)
    for name in spec.blocks:
        if name not in used and not (spec.mtp and spec.mtp.block == name):
            report(("blocks", name), f"block '{name}' is not used by the layer pattern")
    if spec.mtp is not None and spec.mtp.depth >= spec.max_seq:  # no sequence could train it
        report(("mtp", "depth"), f"mtp depth ({spec.mtp.depth}) must be less than max_seq ({spec.max_seq})")
    if spec.mtp is not None and spec.mtp.block not in spec.blocks:
        report(("mtp", "block"), f"unknown block '{spec.mtp.block}' for mtp",
               "blocks: " + ", ".join(spec.blocks))
