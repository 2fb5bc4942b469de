"""What the `Engine` keeps of each request: its settings and tokens on the host (`Request`), and
what it hands back when the request ends (`Result`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Request", "Result", "key_data"]


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request.

    request_id: the id `Engine.submit` returned.
    tokens: int32 [n] new tokens, EOS included when it ended the request.
    finish_reason: "eos" or "length" (max_new_tokens reached).
    logprobs: float32 [n], each token's log-probability under the model (before temperature
      and filters).
    cached_tokens: prompt tokens whose keys and values came from the prefix cache.
    """

    request_id: int
    tokens: np.ndarray
    finish_reason: str
    logprobs: np.ndarray
    cached_tokens: int = 0


@dataclasses.dataclass
class Request:
    """A request's host-side state; `fed` counts prompt tokens already in the cache.

    top_k: the vocabulary size when unfiltered; top_p: 1.0 when unfiltered. variant: the
    weight variant its rows run with (`tfx.nn.row_variants`; 0 = the base weights). keys: its
    shareable prompt pages' keys (`tfx.generation.prefix_cache`); cached: prompt tokens that
    came from the cache.
    """

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    eos: list[int]
    temperature: float
    top_k: int
    top_p: float
    key: np.ndarray
    variant: int = 0
    keys: list[bytes] = dataclasses.field(default_factory=list)
    cached: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    fed: int = 0

    def feed(self, width: int) -> np.ndarray:
        """The tokens this step brings: the next prompt chunk, or the last new token."""
        if self.fed < len(self.prompt):
            return self.prompt[self.fed:self.fed + width]
        return np.asarray(self.tokens[-1:], np.int32)

    def finish_reason(self) -> str | None:
        if self.tokens and self.tokens[-1] in self.eos:
            return "eos"
        return "length" if len(self.tokens) == self.max_new_tokens else None

    def result(self, reason: str) -> Result:
        return Result(self.id, np.asarray(self.tokens, np.int32), reason,
                      np.asarray(self.logprobs, np.float32), self.cached)


def key_data(rng, temperature: float) -> np.ndarray:
    """A request's key as raw uint32 [2] (zeros for a greedy request without one)."""
    if rng is None:
        if temperature > 0:
            raise ValueError("rng must be a jax.random key when temperature > 0 "
                             "(temperature=0.0 decodes greedily)")
        return np.zeros(2, np.uint32)
    if jnp.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    data = np.asarray(rng)
    if data.shape != (2,) or data.dtype != np.uint32:
        raise ValueError(f"rng must be a jax.random key (threefry, raw uint32 [2]), got "
                         f"{getattr(rng, 'shape', rng)!r}")
    return data
