"""tfx: transformer building blocks and models for JAX and Flax NNX.

The subpackages (`tfx.ops`, `tfx.nn`, `tfx.models`, `tfx.hf`, `tfx.peft`, `tfx.parallel`,
`tfx.quant`, `tfx.train`, `tfx.evaluation`) and `tfx.generate` / `tfx.beam_search` /
`tfx.speculative_generate` load on first use, so `import tfx` is quick and imports no jax by itself.
"""

from typing import TYPE_CHECKING

from tfx._lazy import lazy_exports

if TYPE_CHECKING:
    from tfx import evaluation, hf, models, nn, ops, parallel, peft, quant, train
    from tfx.generation import beam_search, generate, speculative_generate

__version__ = "0.1.0"

__all__ = ["beam_search", "evaluation", "generate", "hf", "models", "nn", "ops", "parallel",
           "peft", "quant", "speculative_generate", "train"]

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: f"tfx.{name}" for name in ("evaluation", "hf", "models", "nn", "ops", "parallel",
                                            "peft", "quant", "train")},
    "beam_search": "tfx.generation:beam_search", "generate": "tfx.generation:generate",
    "speculative_generate": "tfx.generation:speculative_generate"})
