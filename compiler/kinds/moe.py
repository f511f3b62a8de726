"""Mixture of experts: a router picks top_k of `experts` dense feed-forwards per token, and
`shared_experts` more see every token. Its apply is mxc.compiler.lower.moe."""

from __future__ import annotations

import math

from mxc.compiler.kinds import kind_of, register
from mxc.compiler.kinds.base import FeedForwardKind, FFNCount, Intermediate, Routing
from mxc.compiler.lower.param_def import ParamDef, UnsupportedError, map_defs, matrix, zeros
from mxc.spec.ir import MoE

Problem = tuple[tuple[str, ...], str, str | None]  # (field path under the layer, message, hint)


def _shared_bias_problem(moe: MoE) -> Problem | None:
    if moe.shared_experts > 1 and moe.expert.bias:
        return (("shared_experts",), f"{moe.shared_experts} shared experts with biases: "
                                     "their output biases do not fuse into one layer",
                "use one shared expert, or experts without bias")
    return None


def _routing_problem(moe: MoE) -> Problem | None:
    r = moe.router
    if moe.top_k > moe.experts:
        return ("top_k",), f"top_k ({moe.top_k}) is larger than experts ({moe.experts})", None
    if moe.experts % r.groups:
        return ("router", "groups"), f"experts ({moe.experts}) are not divisible into {r.groups} groups", None
    if r.top_groups > r.groups:
        return ("router", "top_groups"), f"top_groups ({r.top_groups}) is larger than groups ({r.groups})", None
    if moe.top_k > r.top_groups * (moe.experts // r.groups):
        return ("top_k",), f"top_k ({moe.top_k}) exceeds the experts in the {r.top_groups} chosen groups", None
    return None


def shared_expert_ffn(moe: MoE):
    """The shared experts as one dense feed-forward: n experts of hidden h side by side are one
    of hidden n·h (DeepSeek stores them so). Biased experts would each bring their own output
    bias, which a fused layer cannot hold, so those are refused when n > 1."""
    problem = _shared_bias_problem(moe)
    if problem is not None:
        raise UnsupportedError(problem[1])
    return moe.expert.model_copy(update={"hidden": moe.expert.hidden * moe.shared_experts})


def moe_defs(moe: MoE, d_model: int) -> dict:
    """Router, routed experts stacked on a leading `experts` axis, and the shared experts.

    The router's kernel keeps its expert dimension unsharded: it is small, and top-k wants every
    expert's score of a token on one device. The correction bias is DeepSeek V3's load-balancing
    bias: read in routing, moved by moe.update_correction_biases, never by gradients."""
    problem = _routing_problem(moe)
    if problem is not None:
        raise UnsupportedError(problem[1])
    router = {"kernel": matrix((d_model, moe.experts), ("embed", None))}
    if moe.router.bias:
        router["bias"] = zeros((moe.experts,), (None,))
    if moe.router.correction_bias:
        router["correction_bias"] = zeros((moe.experts,), (None,))
    stack = lambda p: ParamDef((moe.experts, *p.shape), ("experts", *p.axes), p.init)  # noqa: E731
    experts = map_defs(stack, kind_of(moe.expert).param_defs(moe.expert, d_model))
    defs = {"router": router, "experts": experts}
    if moe.shared_experts:
        shared = shared_expert_ffn(moe)
        defs["shared"] = kind_of(shared).param_defs(shared, d_model)
    return defs


# The dropless dispatch's buffers (_dispatch_intermediates), which a layer's backward pass holds
# all at once (mxc.compiler.plan.memory.DISPATCH_WORKING_SET).
DISPATCH_BUFFERS = frozenset({"sorted_assignments", "sent_rows", "received_rows", "grouped_rows", "expert_mlpwi",
                              "expert_mlp_activation", "expert_mlp_hidden", "expert_outputs", "returned_rows",
                              "combined_assignments"})


def _routed_hidden(ffn: MoE, shape, axes, choice) -> list[Intermediate]:
    """The routed experts' feed-forward on `shape` rows, its names prefixed with expert_: their
    input projections (expert_mlpwi) are no product jax's dots policy saves
    (mxc.compiler.plan.activations.DOTS)."""
    return [Intermediate(item.name if item.name == "mlpwo" else f"expert_{item.name}", item.shape, item.axes,
                         item.bytes_per_element)
            for item in kind_of(ffn.expert).hidden_intermediates(ffn.expert, shape, axes, choice)]


def _capacity_intermediates(ffn: MoE, choice) -> list[Intermediate]:
    """The capacity path gives each expert `slots` rows per sequence, filled with the tokens routed
    to it through one-hot dispatch and combine tensors [batch, seq, experts, slots]."""
    from mxc.compiler.lower.moe import capacity

    b, s, d = choice.microbatch, choice.seq, choice.spec.d_model
    act = choice.compute_bytes
    slots = capacity(s, ffn.top_k, ffn.experts, choice.capacity_factor or 1.0)
    out = [Intermediate(name, (b, s, ffn.experts, slots), ("batch", "seq", "experts", None), act)
           for name in ("dispatch", "combine")]
    out.append(Intermediate("expert_inputs", (b, ffn.experts, slots, d), ("batch", "experts", None, "embed"), act))
    return out + _routed_hidden(ffn, (b, ffn.experts * slots, ffn.expert.hidden), ("batch", None, "mlp"), choice)


def dispatch_rows(ffn: MoE, choice) -> tuple[int, int]:
    """(assignments one device routes, rows its experts' buffers hold) on the dropless path. With
    the experts split over `shards` devices (expert_dispatch.py) every device receives a buffer
    with room for all the assignments of each sender; without, each device sorts its own."""
    batch_axes = set(choice.rules.get("batch", ()))
    # Expert axes that do not split the batch split each batch shard's tokens instead (moe.py).
    extra = math.prod(choice.mesh.get(a, 1) for a in choice.rules.get("experts", ()) if a not in batch_axes)
    tokens = -(-choice.microbatch // choice.split("batch")) * choice.seq // extra
    assignments = tokens * ffn.top_k
    return assignments, assignments * choice.split("experts")


def _dispatch_intermediates(ffn: MoE, choice) -> list[Intermediate]:
    """One device's buffers on the dropless path: its sorted assignments, what it receives, the
    received rows grouped by expert through the experts' feed-forward, and back. Shapes are
    already one device's (axes None), the hidden units split like the weights. On TPU the
    exchange is a ragged all-to-all from and into the sorted rows; elsewhere it sends a slot per
    destination as large as the sender's assignments, and receives the returns likewise."""
    d, act = choice.spec.d_model, choice.compute_bytes
    assignments, rows = dispatch_rows(ffn, choice)
    hidden = -(-ffn.expert.hidden // choice.split("mlp"))
    local = lambda name, n: Intermediate(name, (n, d), (None, None), act)  # noqa: E731
    out = [local("sorted_assignments", assignments)]
    if rows > assignments:
        ragged = choice.topology.platform == "tpu"
        out += [local("received_rows", rows), local("returned_rows", assignments if ragged else rows)]
        out += [] if ragged else [local("sent_rows", rows)]
    out += [local("grouped_rows", rows)]
    out += [item for item in _routed_hidden(ffn, (rows, hidden), (None, None), choice) if item.name != "mlpwo"]
    out += [local("expert_outputs", rows), local("combined_assignments", assignments)]
    return out


class MixtureOfExperts(FeedForwardKind):
    ir_classes = (MoE,)

    def check(self, ffn, at, report):
        for problem in (_shared_bias_problem(ffn), _routing_problem(ffn)):
            if problem is not None:
                path, message, hint = problem
                report(at + path, message, hint)

    def routing(self, ffn):
        return Routing(ffn.experts, ffn.top_k)

    def param_defs(self, ffn, d_model):
        return moe_defs(ffn, d_model)

    def param_counts(self, ffn, d_model):
        expert = kind_of(ffn.expert).param_counts(ffn.expert, d_model)
        router = d_model * ffn.experts + (ffn.experts if ffn.router.bias else 0)
        total = router + (ffn.experts + ffn.shared_experts) * expert.total
        active = router + (ffn.top_k + ffn.shared_experts) * expert.total
        matmul = d_model * ffn.experts + (ffn.top_k + ffn.shared_experts) * expert.matmul_active
        return FFNCount(total, active, matmul)

    def input_weights_per_token(self, ffn, d_model):
        return (ffn.top_k + ffn.shared_experts) * kind_of(ffn.expert).input_weights_per_token(ffn.expert, d_model)

    def intermediates(self, ffn, choice):
        b, s = choice.microbatch, choice.seq
        out = [Intermediate("router_probabilities", (b, s, ffn.experts), ("batch", "seq", None), 4)]
        if choice.expert_path == "dropless":
            out += _dispatch_intermediates(ffn, choice)
        else:
            out += _capacity_intermediates(ffn, choice)
        if ffn.shared_experts:
            # Shared experts see every token, as a dense feed-forward does.
            hidden = (b, s * ffn.shared_experts, ffn.expert.hidden)
            out += [item for item in kind_of(ffn.expert).hidden_intermediates(ffn.expert, hidden, ("batch", None, "mlp"),
                                                                               choice) if item.name != "mlpwo"]
        return out

    def apply(self, ffn, params, x, moe):
        from mxc.compiler.lower.moe import moe_layer

        return moe_layer(ffn, params, x, moe)


MIXTURE_OF_EXPERTS = register(MixtureOfExperts())
