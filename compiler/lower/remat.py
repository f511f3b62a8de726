"""Rematerialisation policies by name, so the planner chooses one as data.

The layer code tags the intermediates worth keeping with `jax.ad_checkpoint.checkpoint_name`,
under MaxText's names (below); a policy says which tagged values the backward pass keeps in
device memory, which it offloads to host memory, and recomputes the rest. Policy names are
MaxText's `remat_policy` values, spelled as MaxText spells them, plus "none" (no
rematerialisation). MaxText's `custom` policy is written with its per-name settings:

    custom:decoder_layer_input=offload,query_proj=offload,key_proj=device,out_proj=remat

(a name left out is rematerialised). The model wraps its scanned layer body in jax.checkpoint
with the policy `policy(name)` returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

# The checkpoint names the layer code (block.py, attention.py, mla.py, ffn.py, moe.py) puts on
# its intermediates, as MaxText names them.
DECODER_LAYER_INPUT = "decoder_layer_input"  # each layer's input, the residual stream (block.py)
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
CONTEXT = "context"  # the attention core's output, before the output projection
OUT_PROJ = "out_proj"  # after attention's output projection
MLPWI = "mlpwi"  # the feed-forward's up (and gate) projections, before the activation
MLPWO = "mlpwo"  # after the feed-forward's down projection
CHECKPOINT_NAMES = (DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ, CONTEXT, OUT_PROJ, MLPWI, MLPWO)
# A weight product with a hand-written backward pass (weight_gradients.py, CPU plans) is a custom
# VJP, not a dot_general, so the dot-saving policies would not see it: it carries this name, and
# they save it as they save the plain products.
WEIGHT_PRODUCT = "weight_product"

_QKV = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ)
# The names on values shaped like the residual stream, [batch, seq, d_model].
RESIDUAL_NAMES = (DECODER_LAYER_INPUT, OUT_PROJ, MLPWO)
CUSTOM = "custom"
CUSTOM_SETTINGS = ("device", "offload", "remat")


@dataclass(frozen=True)
class Saved:
    """What a policy keeps for the backward pass. `dots` ("device" or "host") keeps every matmul
    without batch dimensions (the weights' products, tagged or not), MaxText's "minimal"."""

    device: tuple[str, ...] = ()
    host: tuple[str, ...] = ()
    dots: str | None = None
    everything: bool = False  # "none": no rematerialisation at all

    @property
    def offloads(self) -> bool:
        return bool(self.host) or self.dots == "host"


# MaxText's policies (MaxText/layers/decoders.py, get_remat_policy). MaxText tags the gated
# MLP's two input projections mlpwi_0 and mlpwi_1; mxc tags both mlpwi.
_POLICIES: dict[str, Saved] = {
    "none": Saved(everything=True),
    "full": Saved(),
    "minimal": Saved(dots="device"),
    "minimal_with_context": Saved(device=(CONTEXT,), dots="device"),
    "save_dot_with_context_except_mlp": Saved(device=(*_QKV, CONTEXT, OUT_PROJ)),
    "save_dot_except_mlpwi": Saved(device=(*_QKV, OUT_PROJ, MLPWO)),
    "save_dot_except_mlp": Saved(device=(*_QKV, OUT_PROJ)),
    "save_qkv_proj": Saved(device=_QKV),
    "save_out_proj": Saved(device=(OUT_PROJ,)),
    "qkv_proj_offloaded": Saved(host=_QKV),
    "minimal_offloaded": Saved(dots="host"),
}
# Names earlier mxc plans used, for the same policies.
_FORMER_NAMES = {"save_qkv": "save_qkv_proj", "attention_out": "save_out_proj",
                 "save_attention": "save_dot_with_context_except_mlp", "dots": "minimal",
                 "save_qkv_offloaded": "qkv_proj_offloaded"}

POLICY_NAMES = (*_POLICIES, CUSTOM)


def custom(**settings: str) -> str:
    """The policy string of MaxText's custom policy: custom(decoder_layer_input="offload", ...)."""
    return f"{CUSTOM}:" + ",".join(f"{name}={setting}" for name, setting in settings.items())


@functools.lru_cache(maxsize=256)
def saved(name: str) -> Saved:
    """What the policy `name` keeps; a ValueError naming the known policies (or checkpoint
    names and settings, for a custom policy) otherwise."""
    name = _FORMER_NAMES.get(name, name)
    if name in _POLICIES:
        return _POLICIES[name]
    if name == CUSTOM or name.startswith(CUSTOM + ":"):
        return _custom(name)
    raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(POLICY_NAMES)} "
                     f"(custom:NAME=device|offload|remat,...)")


def _custom(name: str) -> Saved:
    body = name[len(CUSTOM) + 1:]
    if not body:
        raise ValueError(f"remat policy {name!r}: custom needs settings, e.g. "
                         f"custom:{DECODER_LAYER_INPUT}=offload,{QUERY_PROJ}=device")
    by_setting: dict[str, list[str]] = {setting: [] for setting in CUSTOM_SETTINGS}
    for item in body.split(","):
        tag, _, setting = item.partition("=")
        if tag not in CHECKPOINT_NAMES:
            raise ValueError(f"remat policy {name!r}: unknown checkpoint name {tag!r}; the names are "
                             f"{', '.join(CHECKPOINT_NAMES)}")
        if setting not in CUSTOM_SETTINGS:
            raise ValueError(f"remat policy {name!r}: {tag} must be one of {', '.join(CUSTOM_SETTINGS)}, "
                             f"not {setting!r}")
        if any(tag in tags for tags in by_setting.values()):
            raise ValueError(f"remat policy {name!r}: {tag} is set twice")
        by_setting[setting].append(tag)
    return Saved(device=tuple(by_setting["device"]), host=tuple(by_setting["offload"]))


def canonical(name: str) -> str:
    """The policy's current name (an earlier plan's name mapped to it); checks the name."""
    saved(name)
    return _FORMER_NAMES.get(name, name)


def needs_host_memory(name: str) -> bool:
    return saved(name).offloads


def host_memory_available(device: jax.Device | None = None) -> bool:
    """Whether offloaded policies can run: the device exposes a pinned host memory space."""
    device = device or jax.devices()[0]
    return any(memory.kind == "pinned_host" for memory in device.addressable_memories())


def policy(name: str, *, host: bool = True) -> Callable | None:
    """The jax.checkpoint policy for `name`; None for "none" (no rematerialisation at all).
    host=False keeps on device what the policy would offload: the same names saved, for backends
    without a host memory space (the CPU backend), where the program is otherwise the same."""
    kept = saved(name)
    if kept.everything:
        return None
    if kept.dots is not None:
        if kept.dots == "host" and host:
            dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src="device",
                                                                           offload_dst="pinned_host")
        else:
            dots = jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(WEIGHT_PRODUCT))
        if not kept.device:
            return dots
        return jax.checkpoint_policies.save_from_both_policies(
            dots, jax.checkpoint_policies.save_only_these_names(*kept.device))
    if kept.host and host:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(kept.device), names_which_can_be_offloaded=list(kept.host),
            offload_src="device", offload_dst="pinned_host")
    if not kept.device and not kept.host:
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*kept.device, *kept.host)


# The residual-shaped names the policy being traced offloads (set by `offloading`).
_OFFLOADED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("offloaded_residuals", default=frozenset())


@contextlib.contextmanager
def offloading(name: str):
    """Trace a model under the policy `name`: the residual-shaped values it offloads are named
    through `named_residual` in the layout the backward pass reads."""
    token = _OFFLOADED.set(frozenset(saved(name).host) & frozenset(RESIDUAL_NAMES))
    try:
        yield
    finally:
        _OFFLOADED.reset(token)


def named_residual(x: jax.Array, name: str) -> jax.Array:
    """`checkpoint_name(x, name)` for a value shaped like the residual stream. Where the policy
    offloads it, x is first pinned to the row-major layout: left free, XLA's TPU backend writes
    the scanned stack of such values to host with the sequence minor ({2,3,1,0}) and the backward
    pass reads it row-major, so between the passes it copies each whole stack back to HBM, lays
    it out again and copies it out (Llama 3.1 8B on v6e-256: two 8 GiB stacks in HBM at once;
    docs/plans.md, "Memory levers"). The values are the same."""
    if name in _OFFLOADED.get() and x.ndim == 3:
        from jax.experimental.layout import Layout, with_layout_constraint

        x = with_layout_constraint(x, Layout(major_to_minor=(0, 1, 2)))
    return checkpoint_name(x, name)
