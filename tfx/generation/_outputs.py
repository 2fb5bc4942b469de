"""What `generate` and `beam_search` return besides the tokens: each row's length."""

from __future__ import annotations

import numpy as np

__all__ = ["lengths"]


def lengths(new_tokens: np.ndarray, eos: list[int], head: int) -> np.ndarray:
    """int32 [rows]: `head` (the columns before the generated tokens) + each row's generated
    tokens up to and including its first EOS (all of them in a row without one).

    new_tokens: int [rows, max_new_tokens], on the host; eos: the EOS ids (may be empty).
    """
    ended = np.isin(new_tokens, eos)
    count = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, new_tokens.shape[1])
    return (head + count).astype(np.int32)
