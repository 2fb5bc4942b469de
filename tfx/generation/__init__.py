"""Decoding with a KV cache: `generate` (greedy and sampling, with logits processors and stop
sequences), `beam_search` (decoders and encoder–decoders), `speculative_generate` (a draft
model proposes, the target verifies) and `Engine` (continuous batching over a paged cache).
The first three take what a call leaves unset from the model's `GenerationConfig`."""

from tfx.generation._inputs import bucket_length
from tfx.generation.beam_search import beam_search
from tfx.generation.config import GenerationConfig
from tfx.generation.early_exit import early_exit_draft
from tfx.generation.engine import Engine, Result
from tfx.generation.generate import generate
from tfx.generation.speculative import speculative_generate

__all__ = ["Engine", "GenerationConfig", "Result", "beam_search", "bucket_length",
           "early_exit_draft", "generate", "speculative_generate"]
