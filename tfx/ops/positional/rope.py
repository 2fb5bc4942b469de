"""Rotary position embeddings (RoPE; Su et al. 2021, RoFormer) and their context-length scalings.

Each feature pair (a, b) of a query or key at position p is rotated by the angle p·inv_i, with
inv_i = theta^(-2i/d), so the dot product of a rotated query and key depends on their positions
only through the offset. Two pairings are in use; they describe the same model up to a fixed
permutation of the q/k features within each head (the one HF applies to Meta's LLaMA weights):

  "half"         pairs (i, i + d/2): HF LLaMA, GPT-NeoX (`rotate_half`).
  "interleaved"  pairs (2i, 2i + 1): RoFormer, GPT-J, Meta's LLaMA code.

Scalings stretch a model's context by changing the frequencies (and, for YaRN, the size of cos
and sin). Each is a frozen dataclass, so it can be a static `jax.jit` argument. The formulas follow
Hugging Face transformers' `modeling_rope_utils.py`; each docstring names the HF fields it mirrors.
HF's `partial_rotary_factor` is `rotary_fraction` here, and every scaling formula uses the rotary
dim d = int(head_dim · rotary_fraction), as HF does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tfx import names
from tfx.ops import _checks

__all__ = [
    "SCALINGS",
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "NTKScaling",
    "ProportionalScaling",
    "RopeScaling",
    "YaRNScaling",
    "apply_rope",
    "rope_frequencies",
]

LAYOUTS = names.ROPE_LAYOUTS


def _unscaled_inv_freq(theta, rotary_dim: int) -> jax.Array:
    """float32 [rotary_dim // 2]: theta^(-2i/d). `theta` may be traced (dynamic NTK)."""
    exponent = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    return 1.0 / theta**exponent


def _ntk_inv_freq(scaling, theta, growth, rotary_dim: int) -> jax.Array:
    """NTK-aware frequencies: the base grows as theta·growth^(d/(d-2)).

    The exponent makes the lowest frequency exactly `growth` times slower while the highest stays.
    """
    if rotary_dim <= 2:
        raise ValueError(
            f"{type(scaling).__name__} needs rotary_dim > 2 (its base exponent is d/(d-2)), "
            f"got {rotary_dim}"
        )
    return _unscaled_inv_freq(theta * growth ** (rotary_dim / (rotary_dim - 2)), rotary_dim)


def _validate_fields(obj, *, floats=(), ints=(), optional_floats=()) -> None:
    """Require positive fields on a frozen dataclass, storing them as Python floats / ints.

    Normalising (2 -> 2.0) keeps equal scalings equal and hash-equal, so jit reuses its cache.
    """
    owner = type(obj).__name__
    for name in (*floats, *ints, *optional_floats):
        value = getattr(obj, name)
        if name in optional_floats and value is None:
            continue
        check = _checks.positive_int if name in ints else _checks.positive_float
        object.__setattr__(obj, name, check(f"{owner}.{name}", value))


class RopeScaling:
    """Base of the scaling parameter objects: frozen dataclasses validated on construction.

    A scaling maps the unscaled frequencies to new ones (`_inv_freq`) and may scale cos and sin
    (`_attention_factor`, 1.0 unless overridden).
    """

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        raise NotImplementedError

    def _attention_factor(self) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """Position interpolation (Chen et al. 2023): every frequency divided by `factor`.

    HF: `rope_parameters = {"rope_type": "linear", "factor": factor}`.
    """

    factor: float

    def __post_init__(self):
        _validate_fields(self, floats=("factor",))

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        return _unscaled_inv_freq(theta, rotary_dim) / self.factor


@dataclasses.dataclass(frozen=True)
class NTKScaling(RopeScaling):
    """Static NTK-aware scaling: base theta·factor^(d/(d-2)) at every length.

    HF has no static NTK rope_type (its "dynamic" type is the length-dependent form below); this
    is the fixed form of /u/bloc97's NTK-aware interpolation.
    """

    factor: float

    def __post_init__(self):
        _validate_fields(self, floats=("factor",))

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        return _ntk_inv_freq(self, theta, self.factor, rotary_dim)


@dataclasses.dataclass(frozen=True)
class DynamicNTKScaling(RopeScaling):
    """Dynamic NTK: the base grows with the length L once L exceeds max_pos.

    base = theta·(factor·L/max_pos - (factor - 1))^(d/(d-2)) for L > max_pos; at L <= max_pos the
    frequencies are the unscaled ones. In `apply_rope`, L = max(positions) + 1 over the whole
    batch, computed inside the compiled function.

    HF: `rope_parameters = {"rope_type": "dynamic", "factor": factor}`, with
    `original_max_position_embeddings` playing the part of HF's `config.max_position_embeddings`
    (HF's dynamic type reads the model's max_position_embeddings). HF's module also remembers the
    longest length it has seen and keeps those frequencies for shorter calls above max_pos; here
    the frequencies depend on the current positions only (HF's result for a fresh module).
    """

    factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        _validate_fields(self, floats=("factor",), ints=("original_max_position_embeddings",))

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        max_pos = self.original_max_position_embeddings
        length = max_pos if seq_len is None else jnp.maximum(seq_len, max_pos).astype(jnp.float32)
        growth = self.factor * length / max_pos - (self.factor - 1)
        return _ntk_inv_freq(self, theta, growth, rotary_dim)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YaRNScaling(RopeScaling):
    """YaRN (Peng et al. 2023): interpolate slow frequencies, keep fast ones, blend in between.

    Frequency i is left alone when its wavelength fits more than `beta_fast` times into the
    original context, divided by `factor` when it fits fewer than `beta_slow` times, and blended
    along a linear ramp over the dims in between (ramp ends rounded outwards when `truncate`).
    cos and sin are multiplied by the attention factor: `attention_factor` if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek), else
    0.1·ln(factor) + 1, where mscale(s, m) = 0.1·m·ln(s) + 1 (1 when s <= 1).

    HF: `rope_parameters = {"rope_type": "yarn", "factor", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}`
    (HF's fallback factor = max_position_embeddings / original is not offered: give `factor`).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _validate_fields(
            self,
            floats=("factor", "beta_fast", "beta_slow"),
            ints=("original_max_position_embeddings",),
            optional_floats=("attention_factor", "mscale", "mscale_all_dim"),
        )
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"YaRNScaling.beta_fast ({self.beta_fast}) must be greater than "
                f"YaRNScaling.beta_slow ({self.beta_slow})"
            )
        if not isinstance(self.truncate, bool):
            kind = type(self.truncate).__name__
            raise TypeError(f"YaRNScaling.truncate must be a bool, got {kind}")

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        if theta <= 1:
            raise ValueError(f"YaRNScaling needs theta > 1 (it divides by log(theta)), got {theta}")

        def dim_with_rotations(rotations: float) -> float:
            # The (fractional) pair index j whose wavelength 2π·theta^(2j/d) fits `rotations`
            # times into the original context: solve theta^(2j/d) = context / (2π·rotations).
            theta_power = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return rotary_dim * math.log(theta_power) / (2 * math.log(theta))

        low, high = dim_with_rotations(self.beta_fast), dim_with_rotations(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        pair = jnp.arange(rotary_dim // 2, dtype=jnp.float32)
        interpolated = jnp.clip((pair - low) / (high - low), 0.0, 1.0)  # share of inv / factor
        inv_freq = _unscaled_inv_freq(theta, rotary_dim)
        return inv_freq * (1 - interpolated) + inv_freq / self.factor * interpolated

    def _attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale is not None and self.mscale_all_dim is not None:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend in between.

    With wavelength w_i = 2π / inv_i and C = original_max_position_embeddings: w_i < C /
    high_freq_factor is kept, w_i > C / low_freq_factor is divided by `factor`, and in between the
    frequency is (1 - s)·inv_i/factor + s·inv_i with s = (C/w_i - low_freq_factor) /
    (high_freq_factor - low_freq_factor).

    HF: `rope_parameters = {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}`; Llama 3.1 uses 8, 1, 4, 8192.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _validate_fields(
            self,
            floats=("factor", "low_freq_factor", "high_freq_factor"),
            ints=("original_max_position_embeddings",),
        )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"Llama3Scaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"Llama3Scaling.low_freq_factor ({self.low_freq_factor})"
            )

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        inv_freq = _unscaled_inv_freq(theta, rotary_dim)
        rotations_in_context = self.original_max_position_embeddings * inv_freq / (2 * math.pi)
        # Clipping the blend weight to [0, 1] covers the kept and the divided bands too.
        kept = (rotations_in_context - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        kept = jnp.clip(kept, 0.0, 1.0)
        return (1 - kept) * inv_freq / self.factor + kept * inv_freq


@dataclasses.dataclass(frozen=True)
class ProportionalScaling(RopeScaling):
    """Proportional RoPE (Gemma 4's full-attention layers): frequencies theta^(-2i/d) / factor
    for the first int(fraction · d // 2) pairs, zero for the rest (d: the rotary width, the
    head's with rotary_fraction 1).

    Unlike a partial rotary (`rotary_fraction`, which rotates the first features with
    frequencies of the rotary width), the pairs stay those of the whole head ("half": i and
    i + d/2) and the exponents use d: the frequencies are the full rotary's first ones, then
    zeros.

    HF: `rope_parameters = {"rope_type": "proportional", "partial_rotary_factor": fraction,
    "factor": factor}`.
    """

    fraction: float
    factor: float = 1.0

    def __post_init__(self):
        for name in ("fraction", "factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ProportionalScaling.{name} must be a number > 0, got "
                                 f"{value!r}")
            object.__setattr__(self, name, float(value))  # 1 and 1.0 hash alike for jit
        if self.fraction > 1.0:
            raise ValueError(f"ProportionalScaling.fraction must be <= 1, got {self.fraction}")

    def _inv_freq(self, rotary_dim: int, theta: float, seq_len) -> jax.Array:
        """float32 [rotary_dim // 2]."""
        rotated = int(self.fraction * rotary_dim // 2)  # transformers' count of rotated pairs
        exponent = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / rotary_dim
        inv_freq = jnp.concatenate([1.0 / theta**exponent,
                                    jnp.zeros(rotary_dim // 2 - rotated, jnp.float32)])
        return inv_freq / self.factor


# Every scaling, for the refusal below and the run configs' type table (tfx.train.config).
SCALINGS = (LinearScaling, NTKScaling, DynamicNTKScaling, YaRNScaling, Llama3Scaling,
            ProportionalScaling)


def rope_frequencies(
    rotary_dim: int,
    *,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
    seq_len: int | jax.Array | None = None,
) -> tuple[jax.Array, float]:
    """Inverse frequencies of RoPE after scaling, and the multiplier of cos and sin.

    Not jit-wrapped itself, so that the multiplier stays a Python float; it is traced as part of
    `apply_rope` (and of any jitted caller).

    Args:
      rotary_dim: number of rotated features per head, even and >= 2.
      theta: the base (HF `rope_theta`).
      scaling: None or one of `SCALINGS`.
      seq_len: int scalar (may be traced), the current length L; read only by DynamicNTKScaling
        (None = unscaled, as HF at init).
    Returns:
      (inv_freq float32 [rotary_dim // 2], attention_scale float: 1.0 except for YaRN).
    """
    rotary_dim = _checks.positive_int("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    theta = _checks.positive_float("theta", theta)
    if scaling is None:
        return _unscaled_inv_freq(theta, rotary_dim), 1.0
    if not isinstance(scaling, RopeScaling):
        names = ", ".join(cls.__name__ for cls in SCALINGS)
        raise TypeError(f"scaling must be None or one of {names}, got {type(scaling).__name__}")
    return scaling._inv_freq(rotary_dim, theta, seq_len), scaling._attention_factor()


@functools.partial(jax.jit, static_argnames=("theta", "layout", "scaling", "rotary_fraction"))
def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    scaling: RopeScaling | None = None,
    rotary_fraction: float = 1.0,
) -> jax.Array:
    """Rotate the first rotary_dim features of each head by position-dependent angles.

    Args:
      x: float [batch, seq, heads, head_dim], queries or keys (any float dtype).
      positions: int [batch, seq] or [seq], the true position of each token (for cached decoding,
        the positions after the cache).
      theta: the base of the frequencies (HF `rope_theta`).
      layout: "half" (pairs (i, i + d/2), HF LLaMA / GPT-NeoX) or "interleaved" (pairs
        (2i, 2i + 1), RoFormer / GPT-J / Meta LLaMA).
      scaling: None or a scaling object (see `rope_frequencies`).
      rotary_fraction: in (0, 1]; rotary_dim = int(head_dim · rotary_fraction) must be even and
        >= 2. Features past rotary_dim pass through unchanged (HF `partial_rotary_factor`).
    Returns:
      x's dtype [batch, seq, heads, head_dim]. Angles, cos and sin are float32.
    """
    _checks.floating("x", x, ndim=4, layout="[batch, seq, heads, head_dim]")
    _checks.integer("positions", positions)
    if positions.ndim not in (1, 2):
        raise ValueError(
            f"positions must have shape [seq] or [batch, seq], got {tuple(positions.shape)}"
        )
    _checks.broadcastable("positions", positions.shape, x.shape[:2], "[batch, seq]")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rotary_fraction = _checks.positive_float("rotary_fraction", rotary_fraction)
    if rotary_fraction > 1:
        raise ValueError(f"rotary_fraction must be in (0, 1], got {rotary_fraction}")
    head_dim = x.shape[-1]
    rotary_dim = int(head_dim * rotary_fraction)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim = int(head_dim * rotary_fraction) = int({head_dim} * {rotary_fraction}) "
            f"= {rotary_dim} must be even and >= 2"
        )

    positions = jnp.broadcast_to(positions, x.shape[:2])
    inv_freq, attention_scale = rope_frequencies(
        # `initial` gives an empty batch or sequence a length; only dynamic NTK reads it, and
        # there any length up to original_max_position_embeddings means "unscaled".
        rotary_dim, theta=theta, scaling=scaling, seq_len=jnp.max(positions, initial=0) + 1
    )
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [batch, seq, 1, d/2]
    cos = jnp.cos(angles) * attention_scale
    sin = jnp.sin(angles) * attention_scale

    rotated = x[..., :rotary_dim].astype(jnp.float32)
    if layout == "half":
        first, second = jnp.split(rotated, 2, axis=-1)
    else:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    first, second = first * cos - second * sin, second * cos + first * sin
    if layout == "half":
        rotated = jnp.concatenate([first, second], axis=-1)
    else:
        rotated = jnp.stack([first, second], axis=-1).reshape(rotated.shape)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
