"""Semantic checks the types alone cannot express; each names the path it is about."""

from __future__ import annotations

from typing import Callable

from mxc.compiler.kinds import kind_of
from mxc.spec.ir import CrossAttention, LongRopeScaling, ModelSpec

Report = Callable[..., None]  # report(path, message, hint=None)


def validate(spec: ModelSpec, report: Report) -> None:
    """The rules of each attention and feed-forward kind live with the kind (mxc.compiler.kinds);
    the ones here are common to all of them."""
    for name, block in spec.blocks.items():
        base = ("blocks", name)
        att = block.attention
        at = base + ("attention",)
        kind_of(att).check(att, at, report)
        if att.window is not None and att.chunk is not None:
            report(at + ("chunk",), "a layer kind takes a sliding window or chunked attention, not both")
        if att.temperature_tuning is not None and att.rope is not None:
            report(at + ("temperature_tuning",), "temperature tuning applies to NoPE layers only (rope = none)")
        if att.rope is not None and isinstance(att.rope.scaling, LongRopeScaling):
            _check_longrope(att.rope.scaling, getattr(att, "qk_rope_head_dim", att.head_dim),
                            at + ("rope", "scaling"), report)
        kind_of(block.mlp).check(block.mlp, base + ("mlp",), report)
        if block.parallel:
            _check_parallel(block, base, report)
    if spec.vision is not None:
        from mxc.compiler.kinds import vision

        vision.check(spec, report)
    from mxc.compiler.kinds.cross_attention import check_entry

    check_entry(spec, report)
    used = set(spec.layer_kinds)
    for name in spec.blocks:
        if name not in used and not (spec.mtp and spec.mtp.block == name):
            report(("blocks", name), f"block '{name}' is not used by the layer pattern")
    if spec.mtp is not None and spec.mtp.depth >= spec.max_seq:  # no sequence could train it
        report(("mtp", "depth"), f"mtp depth ({spec.mtp.depth}) must be less than max_seq ({spec.max_seq})")
    if spec.mtp is not None and spec.mtp.block not in spec.blocks:
        report(("mtp", "block"), f"unknown block '{spec.mtp.block}' for mtp",
               "blocks: " + ", ".join(spec.blocks))


def _check_longrope(scaling: LongRopeScaling, rotary_dim: int, at: tuple, report: Report) -> None:
    # One factor per rotary pair: a list of another length would silently misalign the frequencies.
    for field in ("short_factor", "long_factor"):
        given = len(getattr(scaling, field))
        if given != rotary_dim // 2:
            report(at + (field,), f"longrope {field} has {given} values; the rotary dimension "
                                  f"({rotary_dim}) needs {rotary_dim // 2}, one per pair")


def _check_parallel(block, at: tuple, report: Report) -> None:
    # The parallel block adds both sub-layers' outputs to the residual as they are: no family
    # normalises them after, and cross-attention layers have a gated block of their own.
    if block.post_norm is not None:
        report(at + ("post_norm",), "a parallel block takes no post_norm",
               "drop post_norm, or set parallel = false")
    if isinstance(block.attention, CrossAttention):
        report(at + ("parallel",), "a cross_attention block cannot be parallel", "set parallel = false")
