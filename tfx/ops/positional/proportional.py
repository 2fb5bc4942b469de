"""Proportional RoPE (Gemma 4's full-attention layers, transformers' rope_type
"proportional"): the first `fraction` of each head's rotation pairs turn with the frequencies
theta^(-2i/head_dim) of the whole head, the others not at all.

Unlike a partial rotary (`rotary_fraction`, which rotates the first features with frequencies
of the rotary width), the pairs stay those of the whole head ("half": i and i + head_dim/2) and
the exponents use head_dim: the frequencies are the full rotary's first ones, then zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfx.ops.positional.rope import RopeScaling

__all__ = ["ProportionalScaling"]


@dataclasses.dataclass(frozen=True)
class ProportionalScaling(RopeScaling):
    """Frequencies theta^(-2i/d) / factor for the first int(fraction · d // 2) pairs, zero for
    the rest (d: the rotary width, the head's with rotary_fraction 1).

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
