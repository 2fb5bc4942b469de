"""Argument checks shared by `generate` and `beam_search`, run before anything compiles."""

from __future__ import annotations

import numpy as np

__all__ = ["prompt_and_mask", "token_ids"]


def prompt_and_mask(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """int [batch, length >= 1] ids and their bool mask (all True when None), on the host."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be int [batch, length >= 1], got {ids.dtype} "
                         f"{ids.shape}")
    if attention_mask is None:
        return ids, np.ones(ids.shape, bool)
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {ids.shape}, got "
                         f"{mask.shape}")
    mask = mask.astype(bool)
    if not mask.any(axis=1).all():
        raise ValueError("attention_mask has a row without any real token")
    return ids, mask


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """Token id(s) as a list of ints in [0, vocab_size) (None: empty)."""
    values = [] if value is None else [value] if np.isscalar(value) else list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= v < vocab_size:
            raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {value!r}")
    return [int(v) for v in values]
