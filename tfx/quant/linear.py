"""A linear layer whose kernel is stored quantized, and the variable kind of such weights.

`QuantizedLinear` is an `nnx.Linear` (tfx's `Linear`, so code that looks for linear layers,
such as LoRA's `attach`, finds it) whose `kernel` holds the quantized codes and `kernel_scale`
their scales; the forward dequantizes the kernel and multiplies in the compute dtype. Both are
`Quantized` variables, not `nnx.Param`s: frozen weights that no optimiser and no gradient sees.
"""

from __future__ import annotations

import jax
from flax import nnx

from tfx.nn.linear import Linear

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


class QuantizedLinear(Linear):
    """y = x·dequantize(codes, scale) + bias, the product in the compute dtype (tfx's
    `Linear` with the dequantized kernel as its `weight()`).

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
