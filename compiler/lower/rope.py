"""Rotary position embeddings: frequencies for each scaling kind, and their application.

Frequencies follow HF's `modeling_rope_utils` (computed here in float64 and rounded once);
the halves layout (rotate_half) is the default, adjacent pairs with `interleaved`. LongRoPE has
two frequency sets and picks one per sequence by its length (longrope_frequencies).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mxc.spec.ir import LinearScaling, Llama3Scaling, LongRopeScaling, Rope, YarnScaling


def _plain(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _llama3(inv_freq: np.ndarray, s: Llama3Scaling) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_seq / s.low_freq
    high_wavelen = s.original_max_seq / s.high_freq
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    # Llama 4 sets low_freq == high_freq: no band to blend, and `medium` selects nothing of it.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (s.original_max_seq / wavelen - s.low_freq) / (s.high_freq - s.low_freq)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(theta: float, dim: int, s: YarnScaling) -> tuple[np.ndarray, float]:
    # YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, ramp between.
    def correction_dim(rotations):
        return dim * math.log(s.original_max_seq / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    base = _plain(theta, dim)
    inv_freq = base / s.factor * (1 - extrapolation) + base * extrapolation
    if s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(s.factor)
    return inv_freq, attention_factor


def longrope_attention_factor(s: LongRopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_seq))


def longrope_frequencies(rope: Rope, dim: int) -> tuple[np.ndarray, np.ndarray, float]:
    """LongRoPE (Phi-3): (short inverse frequencies, long ones, factor on cos and sin), each
    rotary frequency divided by its own factor from the short or the long list."""
    s = rope.scaling
    base = _plain(rope.theta, dim)
    short = base / np.asarray(s.short_factor, np.float64)
    long = base / np.asarray(s.long_factor, np.float64)
    return short.astype(np.float32), long.astype(np.float32), longrope_attention_factor(s)


def frequencies(rope: Rope, dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim // 2] as float32, factor on cos and sin). LongRoPE's depend on the
    sequence's length: this gives its short set (rope_angles picks)."""
    scaling = rope.scaling
    attention_factor = 1.0
    if isinstance(scaling, LongRopeScaling):
        short, _, attention_factor = longrope_frequencies(rope, dim)
        return short, attention_factor
    if scaling is None:
        inv_freq = _plain(rope.theta, dim)
    elif isinstance(scaling, LinearScaling):
        inv_freq = _plain(rope.theta, dim) / scaling.factor
    elif isinstance(scaling, Llama3Scaling):
        inv_freq = _llama3(_plain(rope.theta, dim), scaling)
    else:
        assert isinstance(scaling, YarnScaling)
        inv_freq, attention_factor = _yarn(rope.theta, dim, scaling)
    return inv_freq.astype(np.float32), attention_factor


def softmax_scale_correction(rope: Rope | None) -> float:
    """DeepSeek's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)² under YaRN
    (transformers' yarn_apply_mscale); 1 for every other rope and whenever mscale_all_dim is 0."""
    scaling = None if rope is None else rope.scaling
    if not isinstance(scaling, YarnScaling) or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_angles(rope: Rope, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape [*positions.shape, dim // 2], in float32."""
    if isinstance(rope.scaling, LongRopeScaling):
        # As transformers' Phi-3 does: the long factors once the sequence (its largest position
        # in this call, plus one) exceeds original_max_seq, the short ones before; per row, so a
        # row does not depend on the others. A decode step past that point rotates with the long
        # set while the cache keeps what earlier steps wrote (transformers' generate recomputes
        # the prefix once there instead; docs/hf-import.md).
        short, long, attention_factor = longrope_frequencies(rope, dim)
        length = jnp.max(positions, axis=-1, keepdims=True) + 1
        inv_freq = jnp.where((length > rope.scaling.original_max_seq)[..., None], jnp.asarray(long),
                             jnp.asarray(short))
    else:
        inv_freq, attention_factor = frequencies(rope, dim)
        inv_freq = jnp.asarray(inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotate x [batch, seq, heads, dim] by angles [batch, seq, dim // 2]."""
    # The reference casts the tables to the activation dtype before rotating.
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
