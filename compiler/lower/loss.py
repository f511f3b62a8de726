"""Next-token cross entropy with a mask, in float32, plus PaLM's optional z-loss.

The loss is returned as sums over tokens next to the token count, so that gradient accumulation
over microbatches divides once by the token count of the whole batch: accumulating equals one big
batch up to float error, however the masked tokens fall across microbatches.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mxc.compiler.lower.choices import lowering_choices


class LossSums(NamedTuple):
    """Sums over the unmasked tokens of a batch (float32 scalars)."""

    cross_entropy: jax.Array
    z_loss: jax.Array  # z_loss_weight · logsumexp², already weighted
    correct: jax.Array  # tokens whose target has the largest logit (ties count)
    tokens: jax.Array
    # DeepSeek V3's multi-token prediction: the modules' cross entropy, already weighted (mtp.py).
    mtp: jax.Array | float = 0.0
    # MoE load balancing (moe.py): aux_loss_weight · the layers' mean loss · tokens, already weighted.
    aux_loss: jax.Array | float = 0.0
    # Assignments per expert, per MoE layer (moe.expert_loads's nesting), for DeepSeek's bias update.
    expert_load: list | None = None

    def total(self) -> jax.Array:
        return self.cross_entropy + self.z_loss + self.mtp + self.aux_loss


def loss_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
              z_loss_weight: float = 0.0) -> LossSums:
    """logits [batch, seq, vocab] (any float dtype), targets [batch, seq] int, mask [batch, seq]
    (nonzero = counts; None = every token counts)."""
    logits = logits.astype(jnp.float32)  # bf16 logsumexp over a 100k+ vocabulary loses the loss
    weights = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    largest = None
    if lowering_choices().fused_cross_entropy:
        log_normalizer, target_logit, largest = _fused_statistics(logits, targets)
    else:
        log_normalizer, target_logit = _statistics(logits, targets)
    cross_entropy = log_normalizer - target_logit
    # Right when the target's logit is the largest: the maximum logsumexp takes anyway, where an
    # argmax would be one more pass over the logits (and one more kernel to compile).
    largest = jnp.max(logits, axis=-1) if largest is None else largest
    correct = (target_logit >= largest).astype(jnp.float32)
    return LossSums(
        cross_entropy=jnp.sum(cross_entropy * weights),
        # PaLM (Chowdhery et al., 2022, §5) pushes log Z toward 0 to keep bf16 logits stable.
        z_loss=z_loss_weight * jnp.sum(jnp.square(log_normalizer) * weights),
        correct=jnp.sum(correct * weights),
        tokens=jnp.sum(weights),
        mtp=jnp.zeros((), jnp.float32),
        aux_loss=jnp.zeros((), jnp.float32),
    )


def chunked_loss_sums(logits_of, hidden: jax.Array, targets: jax.Array, mask: jax.Array | None, chunks: int, *,
                      z_loss_weight: float = 0.0) -> LossSums:
    """loss_sums(logits_of(hidden), targets, mask) over `chunks` pieces of the sequence, one at a
    time: hidden [batch, seq, embed] -> logits_of -> [batch, seq, vocab]. Each piece's logits are
    rematerialised in the backward pass, so no more than one piece's float32 logits is alive
    (LoweringChoices.loss_chunks). Piece j holds tokens j, j + chunks, j + 2·chunks, ...: a strided
    piece keeps a sequence split over devices (context parallelism) split the same way, where a
    contiguous piece would sit on few devices. The sums are over tokens, so any split gives the
    same loss; the numerics per token are loss_sums's."""
    batch, seq = targets.shape
    if seq % chunks:
        raise ValueError(f"the loss's {chunks} chunks do not divide the sequence of {seq} tokens")
    weights = jnp.ones(targets.shape, jnp.float32) if mask is None else mask

    def pieces(x):  # [batch, seq, ...] -> [chunks, batch, seq / chunks, ...]
        return jnp.moveaxis(x.reshape(batch, seq // chunks, chunks, *x.shape[2:]), 2, 0)

    @jax.checkpoint  # keeps the piece's hidden state, recomputes its logits
    def piece_sums(piece):
        h, t, m = piece
        sums = loss_sums(logits_of(h), t, m, z_loss_weight=z_loss_weight)
        return sums.cross_entropy, sums.z_loss, sums.correct, sums.tokens

    def add(total, piece):
        return tuple(a + b for a, b in zip(total, piece_sums(piece))), None

    zero = jnp.zeros((), jnp.float32)
    (cross_entropy, z_loss, correct, tokens), _ = jax.lax.scan(
        add, (zero, zero, zero, zero), (pieces(hidden), pieces(targets), pieces(weights)))
    return LossSums(cross_entropy=cross_entropy, z_loss=z_loss, correct=correct, tokens=tokens,
                    mtp=zero, aux_loss=zero)


def _statistics(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token: (logsumexp, the target's logit)."""
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot contraction instead of a gather keeps a vocab-sharded logits tensor sharded.
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    return log_normalizer, target_logit


# The same statistics for one device's whole logits (CPU plans: LoweringChoices.fused_cross_entropy).
# Autodiff of _statistics writes the one-hot product and exp(logits - max) as [tokens, vocab]
# arrays in the forward pass and reads them back; here the forward pass only reduces the logits
# (the target's logit is a gather) and the backward pass writes the logits' gradient,
# softmax · g_lse + onehot · g_target, in one pass.
@jax.custom_vjp
def _fused_statistics(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    largest = jnp.max(logits, axis=-1)
    log_normalizer = largest + jnp.log(jnp.sum(jnp.exp(logits - largest[..., None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return log_normalizer, target_logit, largest


def _fused_forward(logits, targets):
    statistics = _fused_statistics(logits, targets)
    return statistics, (logits, targets, statistics[0])


def _fused_backward(residuals, cotangents):
    logits, targets, log_normalizer = residuals
    d_normalizer, d_target, _ = cotangents  # the largest logit only feeds a comparison
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    d_logits = (jnp.exp(logits - log_normalizer[..., None]) * d_normalizer[..., None]
                + jnp.where(vocab == targets[..., None], d_target[..., None], 0.0))
    return d_logits, None


_fused_statistics.defvjp(_fused_forward, _fused_backward)


def loss_metrics(sums: LossSums) -> dict[str, jax.Array]:
    """Per-token means of a batch's sums (a batch with no tokens reports zeros, not NaN)."""
    tokens = jnp.maximum(sums.tokens, 1.0)
    return {
        "loss": sums.total() / tokens,
        "cross_entropy": sums.cross_entropy / tokens,
        "z_loss": sums.z_loss / tokens,
        "mtp_loss": sums.mtp / tokens,
        "aux_loss": sums.aux_loss / tokens,
        "accuracy": sums.correct / tokens,
        "tokens": sums.tokens,
    }


def cross_entropy_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
                       z_loss_weight: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean loss per unmasked token, metrics): the loss to differentiate for one whole batch."""
    metrics = loss_metrics(loss_sums(logits, targets, mask, z_loss_weight=z_loss_weight))
    return metrics["loss"], metrics
