"""Parameter and FLOP accounting read straight off the IR (no JAX needed).

Parameter counts follow the reference implementations tensor by tensor. FLOPs follow MaxText's
accounting (`calculate_tflops_training_per_device`): every matmul weight costs 6 FLOPs per token
in training (2 forward, 4 backward), the embedding lookup costs nothing while the output head is a
matmul, and attention's score and value products are counted for the keys a query actually sees:
half the sequence under a causal mask, at most the window for sliding-window layers, half a
chunk for chunked layers. What each attention and feed-forward kind counts is stated by the kind
(mxc.compiler.kinds); this module adds them up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.vision import param_count as vision_param_count
from mxc.spec.ir import Block, LayerNorm, ModelSpec, RMSNorm


def norm_params(norm, dim: int) -> int:
    if norm is None:
        return 0
    if isinstance(norm, RMSNorm):
        return dim if norm.scale else 0
    assert isinstance(norm, LayerNorm)
    return dim * (2 if norm.bias else 1)


def attention_params(att, d_model: int) -> tuple[int, int]:
    """(all parameters, matmul weights) of one attention layer."""
    return kind_of(att).param_counts(att, d_model)


@dataclass(frozen=True)
class BlockCount:
    total: int  # every parameter of the layer
    active: int  # those one token touches
    matmul_active: int  # the matmul weights one token touches (for FLOPs)
    is_moe: bool


def block_params(block: Block, d_model: int) -> BlockCount:
    att_total, att_weights = attention_params(block.attention, d_model)
    pre_norms = 1 if block.parallel else 2  # a parallel block normalises its input once
    norms = pre_norms * norm_params(block.norm, d_model) + 2 * norm_params(block.post_norm, d_model)
    ffn_kind = kind_of(block.mlp)
    ffn = ffn_kind.param_counts(block.mlp, d_model)
    return BlockCount(att_total + ffn.total + norms, att_total + ffn.active + norms,
                      att_weights + ffn.matmul_active, ffn_kind.routing(block.mlp) is not None)


def attended_keys(att, seq: int) -> float:
    """Keys a query sees on average under the causal mask (MaxText counts causal as half)."""
    if att.chunk is not None and att.chunk < seq:
        return att.chunk / 2
    if att.window is not None and att.window < seq:
        return att.window * (1 - att.window / (2 * seq))
    return seq / 2


def attention_flops_per_token(att, seq: int) -> float:
    """Training FLOPs (forward + backward = 3x forward) of QK^T and AV for one token."""
    qk_dim = att.head_dim
    v_dim = kind_of(att).value_head_dim(att)
    return 3 * 2 * attended_keys(att, seq) * att.heads * (qk_dim + v_dim)


@dataclass(frozen=True)
class Summary:
    name: str
    total_params: int
    active_params: int
    mtp_params: int
    vision_params: int  # the vision tower and its projector, included in total_params
    embedding_params: int
    num_layers: int
    layer_pattern: list[dict]
    layer_kinds: dict[str, dict]
    flops_seq: int
    train_flops_per_token: float
    attention_flops_per_token: float

    def to_json(self) -> dict:
        return asdict(self)


def summarize(spec: ModelSpec, seq: int | None = None) -> Summary:
    seq = seq or min(spec.max_seq, 4096)
    d = spec.d_model
    counts = {name: block_params(block, d) for name, block in spec.blocks.items()}
    embedding = (spec.vocab + spec.embedding.extra_rows) * d
    head = 0 if spec.embedding.tied else spec.vocab * d
    base = embedding + head + norm_params(spec.final_norm, d)
    vision = vision_param_count(spec)
    total = base + sum(counts[k].total for k in spec.layer_kinds) + vision
    active = base + sum(counts[k].active for k in spec.layer_kinds) + vision  # the tower is dense
    mtp = 0
    if spec.mtp is not None:
        # Each module: two input norms, the 2d -> d projection, one block, its output norm;
        # embedding and head are shared with the main model.
        per_module = (3 * norm_params(spec.final_norm, d) + 2 * d * d
                      + counts[spec.mtp.block].total)
        mtp = spec.mtp.depth * per_module
    matmul = spec.vocab * d + sum(counts[k].matmul_active for k in spec.layer_kinds)
    attention = sum(attention_flops_per_token(spec.blocks[k].attention, seq) for k in spec.layer_kinds)
    kinds = {}
    for name, block in spec.blocks.items():
        att, ffn = block.attention, block.mlp
        routing = kind_of(ffn).routing(ffn)
        kinds[name] = {
            "layers": spec.layer_kinds.count(name),
            "attention": att.kind,
            "heads": att.heads,
            "kv_heads": att.kv_heads,
            "window": att.window,
            "chunk": att.chunk,
            "rope": att.rope is not None,
            "ffn": ffn.kind,
            "experts": routing.experts if routing else None,
            "top_k": routing.top_k if routing else None,
            "params": counts[name].total,
            "active_params": counts[name].active,
        }
    return Summary(
        name=spec.name, total_params=total, active_params=active, mtp_params=mtp,
        vision_params=vision,
        embedding_params=embedding, num_layers=spec.num_layers,
        layer_pattern=[{"period": list(s.period), "repeat": s.repeat} for s in spec.layers],
        layer_kinds=kinds, flops_seq=seq,
        train_flops_per_token=6 * matmul + attention, attention_flops_per_token=attention)
