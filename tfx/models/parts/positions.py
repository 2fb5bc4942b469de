"""Where tokens are: rotary positions (`RopeConfig`) and T5's relative attention bias
(`T5BiasConfig`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

from tfx import names
from tfx.models.parts._checks import one_of, positive_int

if TYPE_CHECKING:
    from tfx.ops.positional import RopeScaling
else:  # a runtime annotation that names no jax type (tyro reads it as a fixed field)
    RopeScaling = object

__all__ = ["RopeConfig", "RopeLayout", "T5BiasConfig"]

# The names come from tfx.names (one source, jax-free), as tyro and the CLI read them.
RopeLayout = Literal[names.ROPE_LAYOUTS]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary positions (position="rope"), as `tfx.ops.positional.apply_rope` takes them."""

    theta: float = 10000.0
    """Base wavelength of the rotations."""
    layout: RopeLayout = "half"
    """Which dimensions pair up: "half" (rotate_half, LLaMA/NeoX) or "interleaved" (RoFormer,
    GPT-J)."""
    scaling: RopeScaling | None = None
    """A `tfx.ops.positional` scaling object (linear, ntk, dynamic, yarn, llama3) or None."""
    fraction: float = 1.0
    """Fraction of each head's dimensions rotated (GPT-NeoX's rotary_pct)."""
    local_theta: float | None = None
    """Base wavelength of the "sliding" layers (Gemma 3's rope_local_base_freq), which then
    rotate without `scaling`; None: every layer uses theta and scaling."""
    nope_layers: tuple[int, ...] = ()
    """Layers (0-based) whose self-attention rotates nothing: no positional encoding at all
    (NoPE, Kazemnejad et al. 2023), interleaved with rotating layers (SmolLM3: every fourth)."""

    def __post_init__(self):
        if not self.theta > 0:
            raise ValueError(f"rope.theta must be > 0, got {self.theta}")
        one_of("rope.layout", self.layout, get_args(RopeLayout))
        if self.scaling is not None:
            from tfx.ops.positional import RopeScaling  # a scaling object: jax is loaded

            if not isinstance(self.scaling, RopeScaling):
                raise TypeError(f"rope.scaling must be a RopeScaling or None, got "
                                f"{type(self.scaling).__name__}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"rope.fraction must be in (0, 1], got {self.fraction}")
        if self.local_theta is not None and not self.local_theta > 0:
            raise ValueError(f"rope.local_theta must be > 0 or None, got {self.local_theta}")
        if not isinstance(self.nope_layers, tuple) or not all(
                isinstance(i, int) and i >= 0 for i in self.nope_layers):
            raise TypeError(f"rope.nope_layers must be a tuple of layer indices >= 0, got "
                            f"{self.nope_layers!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5BiasConfig:
    """T5's relative attention bias (position="t5")."""

    num_buckets: int = 32
    """Buckets that key-minus-query offsets fall into, logarithmically spaced."""
    max_distance: int = 128
    """Offsets from this distance on share the last bucket."""

    def __post_init__(self):
        positive_int("t5.num_buckets", self.num_buckets)
        positive_int("t5.max_distance", self.max_distance)
