"""Logical axis names of parameter dimensions, declared where a parameter is made.

A module names what each dimension of a parameter *is* when it creates it, e.g.

    nnx.Linear(d_model, d_ff, kernel_metadata=axes.metadata(EMBED, MLP),
               bias_metadata=axes.metadata(MLP), rngs=rngs)
    nnx.Param(value, **axes.metadata(EXPERT, EMBED, MLP))

and `tfx.parallel` maps the names to mesh axes (its `DEFAULT_RULES`) in one place. A
dimension named None is replicated; a parameter that names no axes (no metadata, or
`metadata()`: norm scales, biases over d_model, fine-tuning parameters) is replicated whole. Layers
stacked by `nnx.vmap` with `transform_metadata={nnx.PARTITION_NAME: LAYERS}` get a leading
LAYERS name on every parameter that names its axes (the others stay without names).

The names:
  VOCAB   the vocabulary (token-embedding rows, output-head columns, the MLM bias)
  EMBED   the model width d_model
  HEADS   attention heads times head_dim (query/key/value outputs, the output projection input)
  MLP     the feed-forward hidden width d_ff
  EXPERT  the experts of a mixture-of-experts layer
  LAYERS  the stacked-layer dimension of `scan_layers=True` models
"""

from __future__ import annotations

__all__ = ["EMBED", "EXPERT", "HEADS", "KEY", "LAYERS", "MLP", "NAMES", "VOCAB", "metadata"]

VOCAB, EMBED, HEADS, MLP, EXPERT, LAYERS = "vocab", "embed", "heads", "mlp", "expert", "layers"
NAMES = (VOCAB, EMBED, HEADS, MLP, EXPERT, LAYERS)

# Flax's own variable-metadata key for axis names: nnx.vmap / nnx.scan's transform_metadata
# insert the stacked axis there, and nnx.get_partition_spec reads it.
KEY = "out_sharding"


def metadata(*axes: str | None) -> dict:
    """Variable metadata naming the logical axis of each dimension of a parameter.

    Args:
      *axes: one name from NAMES (or None: replicated) per dimension, outermost first.
    Returns:
      a dict to pass as `kernel_metadata=` / `bias_metadata=` of nnx.Linear,
      `embedding_metadata=` of nnx.Embed, or as `**kwargs` of `nnx.Param(value, ...)`.
      `eager_sharding=False`: the names are logical, so Flax must not place the value on a
      mesh itself when it is created; tfx.parallel does that with the mapped mesh axes.
    """
    for axis in axes:
        if axis is not None and axis not in NAMES:
            raise ValueError(f"axes: {axis!r} is not a logical axis name; expected one of "
                             f"{NAMES} or None")
    return {KEY: tuple(axes), "eager_sharding": False}
