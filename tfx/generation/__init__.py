"""Decoding with a KV cache: `generate` (greedy and sampling) and `beam_search`
(encoder–decoder models)."""

from tfx.generation.beam_search import beam_search
from tfx.generation.generate import bucket_length, generate

__all__ = ["beam_search", "bucket_length", "generate"]
