"""tfx: transformer building blocks and models for JAX and Flax NNX."""

from tfx.generation import beam_search, generate

__version__ = "0.1.0"

__all__ = ["beam_search", "generate"]
