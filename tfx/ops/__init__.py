"""Pure functions on arrays (jax + numpy only): attention, masks, sparsity, positional encodings.

Exports load on first use (`tfx._lazy`), so `tfx.ops.attention.table` (the kernel names) imports
without jax.
"""

from tfx._lazy import lazy_exports

__all__ = ["IMPLEMENTATIONS", "dot_product_attention", "masks", "positional", "sparse"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "IMPLEMENTATIONS": "tfx.ops.attention.table:IMPLEMENTATIONS",
    "dot_product_attention": "tfx.ops.attention.dispatch:dot_product_attention",
    "masks": "tfx.ops.masks",
    "positional": "tfx.ops.positional",
    "sparse": "tfx.ops.sparse",
    # The attention kernels' former flat modules, now in tfx.ops.attention.
    "context_parallel": "tfx.ops.attention.context_parallel",
    "gpu_attention": "tfx.ops.attention.gpu",
    "paged_attention": "tfx.ops.attention.paged",
    "splash": "tfx.ops.attention.splash",
})
