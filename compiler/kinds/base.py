"""The two families of layer kinds and what each must state about its IR classes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

Report = Callable[..., None]  # report(path, message, hint=None), as spec.validate passes it
Path = tuple  # where in the spec a node sits, e.g. ("blocks", "dense", "attention")
CacheEntries = dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]  # name -> (shape, logical axes)


class AttentionKind(ABC):
    """An attention variant: one layer's token mixing, its parameters, cache and counts."""

    ir_classes: tuple[type, ...] = ()

    def check(self, att, at: Path, report: Report) -> None:
        """Report what the types alone cannot rule out, each at its field under `at`."""

    @abstractmethod
    def param_defs(self, att, d_model: int) -> dict:
        """One layer's parameters (unstacked): a nested dict of ParamDef."""

    @abstractmethod
    def param_counts(self, att, d_model: int) -> tuple[int, int]:
        """(all parameters, matmul weights) of one layer."""

    @abstractmethod
    def projection_weights(self, att, d_model: int) -> tuple[int, int]:
        """Matmul weights each token goes through: (those before the core, the output projection)."""

    @abstractmethod
    def value_head_dim(self, att) -> int:
        """Width of one head's values (and of its context vector)."""

    @abstractmethod
    def cache_entries(self, att, batch: int, length: int) -> CacheEntries:
        """One layer's KV-cache arrays for `batch` sequences of `length` tokens, unstacked."""

    @abstractmethod
    def apply(self, att, params: dict, x, positions, *, cache: dict | None = None, cache_index=None,
              cache_positions=None, impl: str = "xla"):
        """x [batch, seq, embed] -> ([batch, seq, embed], the updated cache slice or None)."""


@dataclass(frozen=True)
class Intermediate:
    """One array a layer's forward pass makes (the planner sizes what remat keeps of them)."""

    name: str  # a checkpoint name, or what an unnamed intermediate is
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    bytes_per_element: int


@dataclass(frozen=True)
class FFNCount:
    total: int  # every parameter of the feed-forward
    active: int  # those one token touches
    matmul_active: int  # the matmul weights one token touches (for FLOPs)


@dataclass(frozen=True)
class Routing:
    experts: int  # routed experts
    top_k: int  # of them, per token


class FeedForwardKind(ABC):
    """A feed-forward variant: dense or routed, its parameters, apply and counts."""

    ir_classes: tuple[type, ...] = ()

    def check(self, ffn, at: Path, report: Report) -> None:
        """Report what the types alone cannot rule out, each at its field under `at`."""

    def routing(self, ffn) -> Routing | None:
        """How tokens are routed to experts; None for a dense feed-forward."""
        return None

    @abstractmethod
    def param_defs(self, ffn, d_model: int) -> dict:
        """One layer's parameters (unstacked): a nested dict of ParamDef."""

    @abstractmethod
    def param_counts(self, ffn, d_model: int) -> FFNCount:
        ...

    @abstractmethod
    def input_weights_per_token(self, ffn, d_model: int) -> int:
        """Matmul weights of the input projections (before the hidden activation) one token uses."""

    @abstractmethod
    def intermediates(self, ffn, choice) -> list[Intermediate]:
        """What the feed-forward makes from its normalised input for one microbatch of `choice`
        (a plan.choice.Choice), in order."""

    @abstractmethod
    def apply(self, ffn, params: dict, x, moe):
        """x [batch, seq, embed] -> ([batch, seq, embed], moe.MoEStats or None); `moe` is the
        MoEConfig the plan chose."""
