"""Argument checks shared by the ops: each raises a tfx error that names the argument.

They run at trace time (shapes and dtypes are static under `jax.jit`), so a bad call fails with
a clear message before any XLA work, never with a raw XLA error or a silent broadcast.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np


def _dtype(name: str, x) -> np.dtype:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    return np.dtype(x.dtype)


def floating(name: str, x, *, ndim: int | None = None, layout: str = "") -> None:
    """Require a floating-point array, optionally of rank `ndim` (`layout` names the axes)."""
    if not jnp.issubdtype(_dtype(name, x), jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    rank(name, x, ndim, layout)


def integer(name: str, x, *, ndim: int | None = None, layout: str = "") -> None:
    """Require an integer array, optionally of rank `ndim`."""
    if not jnp.issubdtype(_dtype(name, x), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    rank(name, x, ndim, layout)


def boolean(name: str, x, *, max_ndim: int | None = None) -> None:
    """Require a boolean array of rank at most `max_ndim`."""
    if _dtype(name, x) != np.bool_:
        raise TypeError(f"{name} must be a boolean array (True = may attend), got {x.dtype}")
    if max_ndim is not None and x.ndim > max_ndim:
        raise ValueError(f"{name} must have at most {max_ndim} dims, got shape {tuple(x.shape)}")


def rank(name: str, x, ndim: int | None, layout: str = "") -> None:
    """Require `x.ndim == ndim` (no-op when `ndim` is None)."""
    if ndim is not None and x.ndim != ndim:
        where = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have {ndim} dims{where}, got shape {tuple(x.shape)}")


def positive_int(name: str, value, *, minimum: int = 1) -> int:
    """Require a Python (or numpy) integer >= `minimum`; returns it as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_float(name: str, value) -> float:
    """Require a real number > 0; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def finite_positive_float(name: str, value) -> float:
    """Require a finite real number > 0 (not inf, not nan); returns it as a float."""
    value = positive_float(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...], axes: str) -> None:
    """Require `shape` to broadcast to `target` with every dim equal to 1 or to the target dim.

    Numpy-style broadcasting would also accept a shorter shape aligned to the right; that is
    allowed too, but a dim that is neither 1 nor the target's is an error, never a silent
    broadcast.
    """
    if len(shape) > len(target) or any(
        s not in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    ):
        raise ValueError(f"{name} of shape {tuple(shape)} must broadcast to {axes} = {target}")

