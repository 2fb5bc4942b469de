"""Pure functions on arrays (jax + numpy only): attention, masks, sparsity, positional encodings."""

from tfx.ops import masks, positional, sparse
from tfx.ops.attention import IMPLEMENTATIONS, dot_product_attention

__all__ = ["IMPLEMENTATIONS", "dot_product_attention", "masks", "positional", "sparse"]
