"""Logical → mesh rules for a mesh: the defaults, the spec's own `shard` block on top, and no
mapping that would split a dimension unevenly.

Defaults follow MaxText's logical axis rules, reduced to the axes mxc plans:
    batch   -> data, fsdp, expert     every batch-like axis splits the tokens
    seq     -> context
    embed   -> fsdp, context, expert  parameters are split over every axis that does not split
                                      them otherwise (ZeRO-3); on an activation these axes are
                                      already taken by batch and seq, so the activation keeps
                                      its embedding whole
    heads, kv_heads, mlp, vocab -> tensor   Megatron-style tensor parallelism
    experts -> expert
    q_lora, kv_lora -> as embed       MLA's low-rank widths, in models that have them (LOW_RANK)
    residual_seq -> context           the residual stream between layers; with sequence
                                      parallelism also tensor (SEQUENCE_PARALLEL)
A mesh axis is used at most once per array (mxc.compiler.lower.sharding.partition_spec), so
`embed -> fsdp` shards a weight and leaves the batch-sharded activation alone.
"""

from __future__ import annotations

from typing import Mapping

from mxc.compiler.plan.layout import Tensor, shard_counts

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    "residual_seq": ("context",),
    "embed": ("fsdp", "context", "expert"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
}


# A low-rank bottleneck's width (MLA's q_lora, kv_lora) splits like embed, as in MaxText's rules:
# it is the contracted dimension of q_b and kv_b, which nothing else would split. Left whole,
# DeepSeek V3's q_b and kv_b (54.5M parameters a layer) sat on every device: on v5p-1024 (fsdp
# 512) 13.5 GB of float32 weights, 27 GB of AdamW moments and their gradients, 179.72 -> 152.84
# GiB at XLA's peak once split. Only for models that have such weights, so that no other plan's
# rules change.
LOW_RANK = ("q_lora", "kv_lora")


# The residual stream's sequence split over tensor too (Megatron's sequence parallelism): each
# tensor shard keeps 1/tensor of it between layers.
SEQUENCE_PARALLEL = ("context", "tensor")


def sequence_parallel(rules: Mapping[str, tuple[str, ...]]) -> bool:
    return "tensor" in rules.get("residual_seq", ())


def make_rules(mesh: Mapping[str, int], tensors: tuple[Tensor, ...], pinned: Mapping[str, tuple[str, ...]] = {},
               ) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """(rules, notes): the defaults with the pinned rules on top, then every mapping that would
    split some parameter dimension unevenly narrowed (its last mesh axis dropped) until all divide.
    A pinned rule is never narrowed; a mesh that splits it unevenly is rejected by `uneven`."""
    used = {axis for tensor in tensors for axis in tensor.axes}
    low_rank = {axis: DEFAULT_RULES["embed"] for axis in LOW_RANK if axis in used}
    rules = {**DEFAULT_RULES, **low_rank, **{k: tuple(v) for k, v in pinned.items()}}
    notes = []
    while True:
        bad = uneven(tensors, rules, mesh)
        if bad is None:
            return rules, notes
        tensor, dim = bad
        logical = tensor.axes[dim]
        if logical in pinned:
            raise ValueError(f"the pinned rule {logical} -> {', '.join(pinned[logical])} splits "
                             f"{tensor.path} {list(tensor.shape)} unevenly on this mesh")
        dropped = rules[logical][-1]
        rules[logical] = rules[logical][:-1]
        notes.append(f"{logical} ({tensor.shape[dim]}) does not split over {dropped} "
                     f"{mesh.get(dropped, 1)}: not sharded over {dropped}")


def uneven(tensors, rules, mesh) -> tuple[Tensor, int] | None:
    """The first (tensor, dimension) these rules would split unevenly, if any."""
    for tensor in tensors:
        for dim, (size, count) in enumerate(zip(tensor.shape, shard_counts(tensor.axes, rules, mesh))):
            if size % count:
                return tensor, dim
    return None
