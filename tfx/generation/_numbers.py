"""Checks of the numbers the decoding functions and `GenerationConfig` take, without jax (so
that a generation config can be read and checked before jax is imported).

Numbers may be Python or numpy scalars (np.float32(0.5), np.int64(3)); NaN and infinities are
refused, as are bools where a number is expected.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["integer", "real"]


def integer(name: str, value, *, minimum: int = 1) -> int:
    """A Python or numpy int >= minimum, as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def real(name: str, value, *, low: float = -math.inf, high: float = math.inf,
         open_low: bool = False, hint: str = "") -> float:
    """A finite Python or numpy real number in [low, high] ((low, high] with open_low), as a
    float; `hint` ends the message."""
    finite = (not isinstance(value, bool) and isinstance(value, numbers.Real)
              and math.isfinite(value))
    if not (finite and (value > low if open_low else value >= low) and value <= high):
        if high < math.inf:
            bounds = f" in {'(' if open_low else '['}{low:g}, {high:g}]"
        else:
            bounds = "" if low == -math.inf else f" {'>' if open_low else '>='} {low:g}"
        raise ValueError(f"{name} must be a finite number{bounds}{hint}, got {value!r}")
    return float(value)
