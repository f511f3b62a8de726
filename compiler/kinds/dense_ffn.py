"""Dense feed-forward kinds: MLP (one input projection) and the gated GLU and GPT-OSS's clamped
SwiGLU (two: gate and up). Their apply is mxc.compiler.lower.ffn; MoE experts are these too."""

from __future__ import annotations

from mxc.compiler.kinds import register
from mxc.compiler.kinds.base import FeedForwardKind, FFNCount, Intermediate
from mxc.compiler.lower.param_def import linear
from mxc.spec.ir import GLU, MLP, ClampedSwiGLU


class DenseFFN(FeedForwardKind):
    """`input_projections` is 1 (up) or 2 (gate and up); `hidden` names the function of
    mxc.compiler.lower.ffn that makes the hidden units from them."""

    def __init__(self, ir_class: type, input_projections: int, hidden: str):
        self.ir_classes = (ir_class,)
        self.input_projections = input_projections
        self._hidden = hidden

    def param_defs(self, ffn, d_model):
        names = ("gate", "up") if self.input_projections == 2 else ("up",)
        defs = {name: linear((d_model,), ("embed",), (ffn.hidden,), ("mlp",), ffn.bias) for name in names}
        defs["down"] = linear((ffn.hidden,), ("mlp",), (d_model,), ("embed",), ffn.bias)
        return defs

    def param_counts(self, ffn, d_model):
        n, h = self.input_projections, ffn.hidden
        weights = (n + 1) * d_model * h
        biases = n * h + d_model if ffn.bias else 0
        return FFNCount(weights + biases, weights + biases, weights)

    def input_weights_per_token(self, ffn, d_model):
        return self.input_projections * d_model * ffn.hidden

    def intermediates(self, ffn, choice):
        b, s = choice.microbatch, choice.seq
        return self.hidden_intermediates(ffn, (b, s, ffn.hidden), ("batch", "seq", "mlp"), choice)

    def hidden_intermediates(self, ffn, shape, axes, choice) -> list[Intermediate]:
        """From the input projections on, with `shape` rows of hidden units (MoE experts have more)."""
        act = choice.compute_bytes
        b, s, d = choice.microbatch, choice.seq, choice.spec.d_model
        return ([Intermediate("mlpwi", shape, axes, act) for _ in range(self.input_projections)]
                + [Intermediate("mlp_activation", shape, axes, act), Intermediate("mlp_hidden", shape, axes, act),
                   Intermediate("mlpwo", (b, s, d), ("batch", "residual_seq", "embed"), act)])

    def hidden(self, ffn, gate, up):
        """The hidden units from the input projections' outputs (gate is None for one input)."""
        from mxc.compiler.lower import ffn as lowering

        return getattr(lowering, self._hidden)(ffn, gate, up)

    def apply(self, ffn, params, x, moe):
        from mxc.compiler.lower.ffn import ffn_layer

        return ffn_layer(ffn, params, x), None


MLP_KIND = register(DenseFFN(MLP, 1, "mlp_hidden"))
GLU_KIND = register(DenseFFN(GLU, 2, "glu_hidden"))
CLAMPED_SWIGLU_KIND = register(DenseFFN(ClampedSwiGLU, 2, "clamped_swiglu_hidden"))
