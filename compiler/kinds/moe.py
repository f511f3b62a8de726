"""Mixture of experts: a router picks top_k of `experts` dense feed-forwards per token, and
`shared_experts` more see every token. Its apply is mxc.compiler.lower.moe."""

from __future__ import annotations

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
        # The capacity path gives each expert `slots` rows per sequence, filled with the tokens
        # routed to it through one-hot dispatch and combine tensors [batch, seq, experts, slots].
        from mxc.compiler.lower.moe import capacity

        b, s, d = choice.microbatch, choice.seq, choice.spec.d_model
        act = choice.compute_bytes
        tokens = ("batch", "seq")
        slots = capacity(s, ffn.top_k, ffn.experts, choice.capacity_factor or 1.0)
        rows = ffn.experts * slots
        out = [Intermediate("router_probabilities", (b, s, ffn.experts), (*tokens, None), 4)]
        out += [Intermediate(name, (b, s, ffn.experts, slots), (*tokens, "experts", None), act)
                for name in ("dispatch", "combine")]
        out.append(Intermediate("expert_inputs", (b, ffn.experts, slots, d), ("batch", "experts", None, "embed"), act))
        # Shared experts see every token once more.
        hidden = (b, rows + s * ffn.shared_experts, ffn.expert.hidden)
        return out + kind_of(ffn.expert).hidden_intermediates(ffn.expert, hidden, ("batch", None, "mlp"), choice)

    def apply(self, ffn, params, x, moe):
        from mxc.compiler.lower.moe import moe_layer

        return moe_layer(ffn, params, x, moe)


MIXTURE_OF_EXPERTS = register(MixtureOfExperts())
