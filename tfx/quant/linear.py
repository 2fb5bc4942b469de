"""A linear layer whose kernel is stored quantized, and the variable kind of such weights.

`QuantizedLinear` is an `nnx.Linear` (so code that looks for linear layers, such as LoRA's
`attach`, finds it) whose `kernel` holds the quantized codes and `kernel_scale` their scales;
the forward dequantizes the kernel and multiplies in the compute dtype. Both are `Quantized`
variables, not `nnx.Param`s: frozen weights that no optimiser and no gradient sees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

try:
    import qwix
except ImportError as error:  # an optional extra: say how to get it
    raise ImportError("tfx.quant needs qwix: pip install 'nnx-transformers[quant]'") from error

__all__ = ["Quantized", "QuantizedLinear"]


class Quantized(nnx.Variable):
    """A frozen weight stored quantized: integer (or NF4) codes, or their float scales.

    Not an `nnx.Param`: `nnx.split(model, nnx.Param, ...)`, `jax.grad` over the Param state and
    `tfx.peft.only_peft` leave it alone, so a quantized base stays frozen by construction.
    """


class QuantizedLinear(nnx.Linear):
    """y = x·dequantize(codes, scale) + bias, the product in the compute dtype.

    Args:
      base: the float `nnx.Linear` to quantize (kernel [..., d_in, d_out]; leading axes, e.g.
        [num_layers] of scanned layers, get scales of their own). Its settings and bias are
        kept, its kernel is replaced.
      kernel: `qwix.QArray` of `base.kernel`: qvalue [..., d_in, d_out] (int8, int4 or uint4
        NF4 codes) and scale [..., d_in / block, d_out] in the kernel's float dtype
        (block = d_in for per-channel scales).
    """

    def __init__(self, base: nnx.Linear, kernel: qwix.QArray):
        for name, value in vars(base).items():  # settings, bias and metadata as they were
            if not name.startswith("_"):
                setattr(self, name, value)
        metadata = base.kernel.get_metadata()
        self.kernel = Quantized(kernel.qvalue, **metadata)
        self.kernel_scale = Quantized(kernel.scale, **metadata)
        self.qtype = kernel.qtype

    def weight(self) -> jax.Array:
        """The dequantized kernel [..., d_in, d_out], in the scale's dtype (the float
        kernel's)."""
        return qwix.dequantize(qwix.QArray(self.kernel[...], self.kernel_scale[...],
                                           qtype=self.qtype))

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        """[..., d_in] -> [..., d_out], in `dtype` (else the inputs' and scale's common type)."""
        weight = self.weight()
        dtype = self.dtype or jnp.result_type(inputs.dtype, weight.dtype)
        kwargs = {"out_sharding": out_sharding}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        y = self.dot_general(inputs.astype(dtype), weight.astype(dtype),
                             (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision,
                             **kwargs)
        if self.bias is not None:
            y += self.bias[...].astype(dtype)
        return y
