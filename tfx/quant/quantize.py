"""`quantize`: replace a model's linear layers by quantized ones, in place (a transform of the
model, as `tfx.peft` methods are; the model classes know nothing of it)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tfx.nn.linear import is_plain
from tfx.nn.paths import path_name
from tfx.peft.core import find_modules, path_matcher, set_module
from tfx.quant.linear import QuantizedLinear, qwix

__all__ = ["QTYPES", "quantize"]

# qtype name -> Qwix's qtype; the names are tfx.names.QUANT_TYPES (the command line's choices),
# kept equal to these keys by tests/train/test_config_literals.py. int8 / int4: symmetric
# absmax, scale = max|w| / (qmax + 0.5) (Qwix's convention: the extreme code's bucket is a full
# unit wide), codes round(w / scale) clipped to the type. nf4: the 16 NormalFloat values of
# QLoRA (Dettmers et al. 2023) times the block's max|w|, each weight its nearest code.
QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}
# Default block along d_in: int8 keeps one scale per output channel; the 4-bit types use
# QLoRA's 64-weight blocks (16 levels cannot span a whole column's range well).
BLOCK_SIZES = {"int8": None, "int4": 64, "nf4": 64}
# MoE routers are read as a matrix by the routing op, not called: they stay float (and small).
_NEVER = ("router",)


def quantize(model: nnx.Module, qtype: str = "int8", *,
             targets: str | tuple[str, ...] | None = None,
             block_size: int | None = None) -> nnx.Module:
    """Quantize the kernels of `model`'s linear layers (weight-only), in place; returns it.

    Args:
      model: any tfx model (or NNX module) whose projections are plain `nnx.Linear` layers,
        unstacked or stacked for `nnx.scan` (kernels [num_layers, d_in, d_out]). Embeddings,
        norms and a tied output head (the embedding table) stay float.
      qtype: "int8" (per output channel), "int4" or "nf4" (blocks of `block_size` weights
        along d_in, per output channel).
      targets: which layers, as `tfx.peft.LoRA`'s targets (a regex over module paths or a
        tuple of module names); None: every linear layer (an untied head included) but MoE
        routers.
      block_size: weights per scale along d_in (must divide d_in); None: the qtype's default
        (`BLOCK_SIZES`; int8's None is one block of all d_in, i.e. per channel).
    Returns:
      `model`, its chosen layers now `QuantizedLinear` (codes and scales as `Quantized`
      variables; the float kernels are dropped).
    Raises:
      TypeError: for a model that is not an NNX module.
      ValueError: for an unknown qtype, a block_size that is not a positive int dividing a
        target's d_in, targets matching no plain linear layer, or naming a router or a layer
        that is already quantized or adapted (quantize before attaching LoRA).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    if block_size is not None and (isinstance(block_size, bool)
                                   or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be an int >= 1 or None, got {block_size!r}")
    block = BLOCK_SIZES[qtype] if block_size is None else block_size
    for path, module in _targets(model, targets):
        set_module(model, path, QuantizedLinear(module, _quantized(
            path_name(path), module.kernel[...], QTYPES[qtype], block)))
    return model


def _targets(model: nnx.Module, targets) -> list[tuple[tuple, nnx.Linear]]:
    """(graph path, layer) of the linear layers `targets` chooses; checks them."""
    matches = (lambda name: not name.endswith(_NEVER)) if targets is None else path_matcher(
        targets)
    chosen = [(p, m) for p, m in find_modules(model, nnx.Linear) if matches(path_name(p))]
    if not chosen:
        raise ValueError(f"quantize targets {targets!r} match no linear layer; linear layers: "
                         f"{[path_name(p) for p, _ in find_modules(model, nnx.Linear)]}")
    for path, module in chosen:
        name = path_name(path)
        if name.endswith(_NEVER):
            raise ValueError(f"targets: {name} is an MoE router, read as a matrix by the "
                             "routing op; it cannot be quantized")
        if not is_plain(module):
            raise ValueError(f"targets: {name} is a {type(module).__name__}, not a plain "
                             "nnx.Linear; quantize a plain model once, before attaching LoRA")
    return chosen


def _quantized(name: str, kernel, qtype, block: int | None) -> qwix.QArray:
    """Qwix's QArray of kernel [..., d_in, d_out]: scales per output channel and per leading
    index (stacked layers), and per `block` weights along d_in when block is not None."""
    d_in = kernel.shape[-2]
    if block is not None and d_in % block:
        raise ValueError(f"block_size ({block}) must divide d_in of {name} ({d_in})")
    axes = [axis for axis in range(kernel.ndim) if axis != kernel.ndim - 2]
    tiles = None if block is None or block == d_in else {kernel.ndim - 2: block}
    return qwix.quantize(kernel, qtype, channelwise_axes=axes, tiled_axes=tiles)
