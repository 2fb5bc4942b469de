"""Scaled dot-product attention as a package of kernels.

Each kernel is a record (`kernel.Kernel`: name, needs, run) in its own module: `reference`,
`blocked` (with its tiles: `blocked_attention`, `blocked_pieces`, `block_plan`, `tile_sizes`,
`residue_order`), `gpu` (cuDNN, Pallas GPU), `splash` (TPU), `context_parallel`; `paged` holds
the paged-cache kernels. `table.KERNELS` lists them, one line each, and `dispatch`, the public
entry point, selects and runs from that one table. A new kernel is its module and one line in
`table`.

This package imports nothing on import (its exports load on first use), so the kernel names
(`IMPLEMENTATIONS`, from `table`) are importable without jax.
"""

from tfx._lazy import lazy_exports

__all__ = ["BLOCKED_MIN_SCORES", "IMPLEMENTATIONS", "cached_attention", "dot_product_attention",
           "static_spec"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "BLOCKED_MIN_SCORES": "tfx.ops.attention.blocked:BLOCKED_MIN_SCORES",
    "IMPLEMENTATIONS": "tfx.ops.attention.table:IMPLEMENTATIONS",
    "cached_attention": "tfx.ops.attention.dispatch:cached_attention",
    "dot_product_attention": "tfx.ops.attention.dispatch:dot_product_attention",
    "static_spec": "tfx.ops.attention.dispatch:static_spec",
})
