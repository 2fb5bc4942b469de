"""Flax NNX modules: thin wrappers that own parameters and call `tfx.ops`."""

from tfx.nn.attention import Attention, Rope
from tfx.nn.embeddings import LearnedPositions, SinusoidalPositions, TokenEmbedding
from tfx.nn.mlp import ACTIVATIONS, MLP
from tfx.nn.norms import NORMS, make_norm
from tfx.nn.relative_bias import RelativePositionBias

__all__ = ["ACTIVATIONS", "MLP", "NORMS", "Attention", "LearnedPositions",
           "RelativePositionBias", "Rope", "SinusoidalPositions", "TokenEmbedding", "make_norm"]
