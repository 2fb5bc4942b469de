"""Decoding with a KV cache: `generate` (greedy and sampling)."""

from tfx.generation.generate import bucket_length, generate

__all__ = ["bucket_length", "generate"]
