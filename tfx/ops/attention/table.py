"""The attention kernels of `tfx.ops.dot_product_attention`: one line each, importable without
jax (the config's `AttentionImplementation` and the command line's choices read the names).

Each line names a kernel and the `tfx.ops.attention.kernel.Kernel` record that defines it
("module:attribute", loaded on first use by `tfx.ops.attention.dispatch`). The order is the
order in which `implementation=None` tries them: the first kernel tried on the platform whose
needs all hold runs; "reference" runs everywhere, so it ends the table. A new kernel is its
module (with its record) and one line here.
"""

__all__ = ["IMPLEMENTATIONS", "KERNELS"]

KERNELS = {
    # Under a mesh that splits the sequence, attention that can run context-parallel does.
    "context_parallel": "tfx.ops.attention.context_parallel:KERNEL",
    "cudnn": "tfx.ops.attention.gpu:CUDNN",
    "pallas_gpu": "tfx.ops.attention.gpu:PALLAS_GPU",
    "splash": "tfx.ops.attention.splash:KERNEL",
    "blocked": "tfx.ops.attention.blocked:KERNEL",
    "reference": "tfx.ops.attention.reference:KERNEL",
}
IMPLEMENTATIONS = tuple(KERNELS)
