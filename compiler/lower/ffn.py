"""Dense feed-forward layers: MLP, GLU and GPT-OSS's clamped SwiGLU (their kinds: kinds/dense_ffn.py).

Named checkpoints: mlpwi (the input projections' outputs) and mlpwo (the down projection's).
`hidden_activation` is the part between the projections, shared with the MoE experts (moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxc.compiler.kinds import kind_of
from mxc.compiler.kinds.dense_ffn import DenseFFN
from mxc.compiler.lower.param_def import UnsupportedError
from mxc.compiler.lower.projection import project, project_split
from mxc.compiler.lower.remat import named_residual
from mxc.compiler.lower.sharding import RESIDUAL_AXES, constrain
from mxc.compiler.lower.stacking import project_pair, stacked_projections

CHECKPOINT_NAMES = ("mlpwi", "mlpwo")

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    # HF's gelu_pytorch_tanh, Gemma's activation.
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def mlp_hidden(ffn, gate: None, up: jax.Array) -> jax.Array:
    return ACTIVATIONS[ffn.act](up)


def glu_hidden(ffn, gate: jax.Array, up: jax.Array) -> jax.Array:
    return ACTIVATIONS[ffn.act](gate) * up


def clamped_swiglu_hidden(ffn, gate: jax.Array, up: jax.Array) -> jax.Array:
    gate = jnp.minimum(gate, ffn.limit)
    up = jnp.clip(up, -ffn.limit, ffn.limit)
    return gate * jax.nn.sigmoid(ffn.alpha * gate) * (up + 1)


def _dense_kind(ffn) -> DenseFFN:
    kind = kind_of(ffn)
    if not isinstance(kind, DenseFFN):
        raise UnsupportedError(f"{ffn.kind} feed-forward is not a dense feed-forward (see moe.py)")
    return kind


def hidden_activation(ffn, gate: jax.Array | None, up: jax.Array) -> jax.Array:
    """The hidden units from the input projections' outputs (gate is None for an MLP)."""
    return _dense_kind(ffn).hidden(ffn, gate, up)


def _linear(x, params, dtype, axes):
    return constrain(project(x, params, "...i,io->...o", dtype, mlp=True), axes)


def ffn_layer(ffn, params: dict, x: jax.Array) -> jax.Array:
    """x [batch, seq, embed] -> [batch, seq, embed]."""
    _dense_kind(ffn)
    dtype = x.dtype
    hidden_axes = ("batch", "seq", "mlp")
    if "gate_up" in params:  # CPU serving: the kernels joined once, at conversion (layer_layout.py)
        units = params["gate_up"]["kernel"].shape[-1] // 2
        gate, up = (checkpoint_name(constrain(y, hidden_axes), "mlpwi") for y in
                    project_split(x, params["gate_up"], "...i,io->...o", dtype, (units, units), -1, mlp=True))
    elif "gate" in params and stacked_projections():
        gate, up = (checkpoint_name(constrain(y, hidden_axes), "mlpwi")
                    for y in project_pair(x, params["gate"], params["up"], dtype, "...i,iko->k...o", mlp=True))
    else:
        up = checkpoint_name(_linear(x, params["up"], dtype, hidden_axes), "mlpwi")
        gate = None
        if "gate" in params:
            gate = checkpoint_name(_linear(x, params["gate"], dtype, hidden_axes), "mlpwi")
    hidden = hidden_activation(ffn, gate, up)
    out = _linear(hidden, params["down"], dtype, RESIDUAL_AXES)
    return named_residual(out, "mlpwo")
