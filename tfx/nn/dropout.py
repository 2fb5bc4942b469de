"""Dropout that carries random state only when it is on."""

from __future__ import annotations

from flax import nnx

__all__ = ["make_dropout"]


def make_dropout(rate: float, *, rngs: nnx.Rngs) -> nnx.Dropout:
    """nnx.Dropout(rate), holding an RNG stream only when rate > 0.

    A model without dropout (every loaded checkpoint, eval-only use) then has no random state
    at all, so functional use that closes over the non-parameter state, and `nnx.scan` over
    layers, see parameters only.
    """
    return nnx.Dropout(rate, rngs=rngs if rate > 0 else None)
