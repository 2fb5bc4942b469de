"""`flat_linear`: the `nnx.Linear` every tfx projection is, computing [..., in] · [in, out] as one
flat 2-D matmul (`tfx.ops.matmul.flat_dot_general`; why, there).

It returns a plain `nnx.Linear` (the product is its `dot_general`), so code that looks for
linear layers (fine-tuning, quantization, checkpoint import) sees no new class, and the
transforms that rebuild a layer from its attributes keep the flat product.
"""

from __future__ import annotations

from flax import nnx

from tfx.ops.matmul import flat_dot_general

__all__ = ["flat_linear"]


def flat_linear(in_features: int, out_features: int, **kwargs) -> nnx.Linear:
    """`nnx.Linear(in_features, out_features, **kwargs)` with the flat matmul."""
    return nnx.Linear(in_features, out_features, dot_general=flat_dot_general, **kwargs)
