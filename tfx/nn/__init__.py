"""Flax NNX modules: thin wrappers that own parameters and call `tfx.ops`."""

from tfx.nn.attention import Attention

__all__ = ["Attention"]
