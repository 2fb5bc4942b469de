"""tfx: transformer building blocks and models for JAX and Flax NNX."""

__version__ = "0.1.0"
