"""Layer kinds: what each attention and feed-forward variant of the IR is, in one module per kind.

A kind object serves the IR classes it lists in `ir_classes` and states everything the compiler
needs to know about them: the validation rules beyond the types (with their locations), the
parameter definitions with logical axes, apply (the lowering), the KV-cache entries, and the
counts that analysis and the planner read (parameters, matmul weights, activation shapes).
Everything else asks the registry, `kind_of(node)`, instead of testing IR classes.

The built-in kinds (attention.py: MHA, GQA, MQA; mla.py: MLA; dense_ffn.py: MLP, GLU,
ClampedSwiGLU; moe.py: MoE; cross_attention.py: CrossAttention) are registered on the first
lookup. Adding a kind: an IR class in spec/ir.py (and its spelling in the grammar), one module
here with a kind object subclassing AttentionKind or FeedForwardKind, and its name in
BUILTIN_MODULES.
"""

from __future__ import annotations

import importlib
from mxc.compiler.kinds.base import AttentionKind, FeedForwardKind, FFNCount, Routing

__all__ = ["AttentionKind", "FeedForwardKind", "FFNCount", "Routing", "UnregisteredKindError",
           "kind_of", "register", "unregister"]

BUILTIN_MODULES = ("attention", "mla", "dense_ffn", "moe", "cross_attention")

_REGISTRY: dict[type, AttentionKind | FeedForwardKind] = {}
_loaded = False


class UnregisteredKindError(TypeError):
    """An IR node whose class no layer kind serves."""


def register(kind: AttentionKind | FeedForwardKind) -> AttentionKind | FeedForwardKind:
    """Make `kind` the one that serves each of its `ir_classes`; returns it."""
    for cls in kind.ir_classes:
        if cls in _REGISTRY and _REGISTRY[cls] is not kind:
            raise ValueError(f"{cls.__name__} already has a layer kind ({type(_REGISTRY[cls]).__name__})")
        _REGISTRY[cls] = kind
    return kind


def unregister(kind: AttentionKind | FeedForwardKind) -> None:
    for cls in kind.ir_classes:
        if _REGISTRY.get(cls) is kind:
            del _REGISTRY[cls]


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True  # first: the modules register themselves on import
        for name in BUILTIN_MODULES:
            importlib.import_module(f"{__name__}.{name}")


def kind_of(node) -> AttentionKind | FeedForwardKind:
    """The kind serving `type(node)` exactly (a subclass is a kind of its own)."""
    _load_builtins()
    try:
        return _REGISTRY[type(node)]
    except KeyError:
        raise UnregisteredKindError(
            f"no layer kind is registered for {type(node).__name__} "
            f"(kind {getattr(node, 'kind', '?')!r}); see mxc.compiler.kinds") from None

