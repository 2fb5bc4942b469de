"""Flax NNX modules: thin wrappers that own parameters and call `tfx.ops`."""

from tfx.nn.attention import Attention, CrossKV, Keys, NoCache
from tfx.nn.caches import KVLayer, SegmentLayer
from tfx.nn.embeddings import LearnedPositions, SinusoidalPositions, TokenEmbedding
from tfx.nn.gated_delta_net import DeltaState, GatedDeltaNet
from tfx.nn.latent_attention import LatentAttention
from tfx.nn.mlp import ACTIVATIONS, MLP
from tfx.nn.norms import NORMS, make_norm
from tfx.nn.positions import ALiBi, Position, Rotary, TransformerXL
from tfx.nn.relative_bias import RelativePositionBias
from tfx.nn.variants import current_row_variants, row_variants

__all__ = ["ACTIVATIONS", "MLP", "NORMS", "ALiBi", "Attention", "CrossKV", "DeltaState",
           "GatedDeltaNet", "KVLayer", "Keys", "LatentAttention", "LearnedPositions", "NoCache",
           "Position", "RelativePositionBias", "Rotary", "SegmentLayer", "SinusoidalPositions",
           "TokenEmbedding", "TransformerXL", "current_row_variants", "make_norm", "row_variants"]
