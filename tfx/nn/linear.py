"""`Linear`: the `nnx.Linear` every tfx projection is. It computes [..., in] · [in, out] as one
flat 2-D matmul (`tfx.ops.matmul.flat_dot_general`, its `dot_general`) and adds its bias with
`tfx.ops.matmul.add_bias`, whose gradient is a matmul too (why, there).

A subclass of `nnx.Linear` with the same parameters, settings and checkpoint layout, so code
that looks for linear layers (fine-tuning, quantization, checkpoint import) finds it, and the
transforms that rebuild a layer from its attributes keep the flat product. `is_plain` tells a
layer whose kernel is its whole weight from the fine-tuned and quantized forms built on it.
"""

from __future__ import annotations

import jax
from flax import nnx

from tfx.ops.matmul import add_bias, flat_dot_general

__all__ = ["Linear", "flat_linear", "is_plain"]


class Linear(nnx.Linear):
    """`nnx.Linear`, its bias added by `add_bias`. `weight()` is the [..., in, out] matrix the
    product uses (subclasses that store it otherwise, e.g. quantized, override it)."""

    def weight(self) -> jax.Array:
        return self.kernel[...]

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """[..., in] -> [..., out], in `dtype` (else the common type of inputs and weights)."""
        bias = self.bias[...] if self.bias is not None else None
        inputs, weight, bias = self.promote_dtype((inputs, self.weight(), bias),
                                                  dtype=self.dtype)
        kwargs = {"out_sharding": out_sharding}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        y = self.dot_general(inputs, weight, (((inputs.ndim - 1,), (0,)), ((), ())),
                             precision=self.precision, **kwargs)
        return y if bias is None else add_bias(y, bias.astype(y.dtype))


def flat_linear(in_features: int, out_features: int, **kwargs) -> Linear:
    """`Linear(in_features, out_features, **kwargs)` with the flat matmul."""
    return Linear(in_features, out_features, dot_general=flat_dot_general, **kwargs)


def is_plain(module: nnx.Module) -> bool:
    """Whether `module` is a linear layer whose kernel is its whole weight: `nnx.Linear` or
    `Linear`, not a subclass that adds a term to it or stores it otherwise (quantized)."""
    return type(module) in (nnx.Linear, Linear)
