"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2020): h + up(act(down(h))) on the
output of a layer's branches, every model weight frozen.

    model = Adapters(placement="pfeiffer", size=16).attach(model, rngs=nnx.Rngs(0))

Placements: "houlsby" puts one after the self-attention and one after the MLP of every layer,
"pfeiffer" one after the MLP only. With `cross_attention=True` the decoder layers of an
encoder–decoder also get one after their cross-attention (adapter-transformers' `cross_adapter`,
off by default there too). `attach` extends each Block with `Adapted` in place (its class
swapped, so weights keep their paths), which applies each adapter to its branch's output
before dropout and the residual sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.block import Block
from tfx.models.stack import Stack
from tfx.ops.activations import ACTIVATIONS
from tfx.peft.core import PeftParam, extend, find_modules, retract
from tfx.peft.settings import AdapterSettings

__all__ = ["PLACEMENTS", "Adapted", "Adapter", "Adapters", "detach"]

# The AdaptedBlock attributes that each placement fills.
PLACEMENTS = {"houlsby": ("attention_adapter", "mlp_adapter"), "pfeiffer": ("mlp_adapter",)}


class Adapted(Block):
    """An extension (`tfx.peft.core.extend`): a Block whose branches' outputs pass through their
    adapters: attributes attention_adapter, cross_adapter and mlp_adapter, Adapter or None."""

    def residual(self, branch: str, x: jax.Array, h: jax.Array) -> jax.Array:
        adapter = getattr(self, f"{branch}_adapter")
        return super().residual(branch, x, h if adapter is None else adapter(h))


class Adapter(nnx.Module):
    """h -> h + up(act(down(h))), [batch, seq, d_model] -> same; PeftParam weights
    down [d_model, size], up [size, d_model] and, with use_bias, biases [size] and [d_model].

    Args:
      init_std: standard deviation of the normal initialisation of down and up (biases start
        at zero), so the adapter starts near the identity.
      zero_up: start `up` at zero: exactly the identity at initialisation.
    """

    def __init__(self, d_model: int, size: int, *, activation: str = "relu",
                 init_std: float = 1e-2, zero_up: bool = False, use_bias: bool = True,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        normal = jax.nn.initializers.normal(init_std)
        self.activation = activation
        self.down = PeftParam(normal(rngs.params(), (d_model, size), param_dtype))
        self.up = PeftParam(jnp.zeros((size, d_model), param_dtype) if zero_up
                            else normal(rngs.params(), (size, d_model), param_dtype))
        self.down_bias = PeftParam(jnp.zeros((size,), param_dtype)) if use_bias else None
        self.up_bias = PeftParam(jnp.zeros((d_model,), param_dtype)) if use_bias else None

    def __call__(self, h: jax.Array) -> jax.Array:
        def project(x, kernel, bias):
            y = x @ kernel[...].astype(x.dtype)
            return y if bias is None else y + bias[...].astype(x.dtype)

        z = ACTIVATIONS[self.activation](project(h, self.down, self.down_bias))
        return h + project(z, self.up, self.up_bias)


class Adapters(AdapterSettings):
    """Bottleneck adapters: their settings (`tfx.peft.settings.AdapterSettings`) and how they
    attach."""

    def attach(self, model: nnx.Module, *, rngs: nnx.Rngs) -> nnx.Module:
        """Put adapters (in place) into every layer of `model`, a tfx Decoder, Encoder or
        EncoderDecoder; returns it. Layers stacked by scan_layers get stacked adapters
        (leading axis num_layers)."""
        stacks = [stack for _, stack in find_modules(model, Stack)]
        if not stacks:
            raise TypeError(f"model must be a tfx model with transformer layers, got "
                            f"{type(model).__name__}")
        config = model.config
        size = self.size or config.d_model // self.reduction
        if size < 1:
            raise ValueError(f"reduction ({self.reduction}) exceeds d_model ({config.d_model}): "
                             f"no bottleneck left; give size instead")
        hooks = PLACEMENTS[self.placement]
        if self.cross_attention:
            if not any(_layers(stack)[0].cross_attention is not None for stack in stacks):
                raise ValueError("cross_attention=True needs a model with cross-attention "
                                 "(an EncoderDecoder)")
            hooks = (*hooks, "cross_adapter")
        if any(isinstance(block, Adapted) for stack in stacks for block in _layers(stack)):
            raise ValueError("the model already has adapters")

        def make(rngs):
            return Adapter(config.d_model, size, activation=self.activation,
                           init_std=self.init_std, zero_up=self.zero_up, use_bias=self.use_bias,
                           param_dtype=jnp.dtype(config.compute.param_dtype), rngs=rngs)

        for stack in stacks:
            blocks = _layers(stack)
            if stack.scan_layers:  # one adapter per layer, stacked like the layer weights
                count = jax.tree.leaves(nnx.state(stack.layers, nnx.Param))[0].shape[0]
                build = nnx.split_rngs(splits=count)(nnx.vmap(make, in_axes=(0,), out_axes=0))
            else:
                build = make
            for block in blocks:
                extend(block, Adapted)
                for hook in ("attention_adapter", "cross_adapter", "mlp_adapter"):
                    wanted = hook in hooks and (hook != "cross_adapter"
                                                or block.cross_attention is not None)
                    setattr(block, hook, build(rngs) if wanted else nnx.data(None))
        return model


def detach(model: nnx.Module) -> nnx.Module:
    """Remove every adapter from `model` (in place): its Blocks become plain again."""
    for _, block in find_modules(model, Adapted):
        for hook in ("attention_adapter", "cross_adapter", "mlp_adapter"):
            delattr(block, hook)
        retract(block, Adapted)
    return model


def _layers(stack: Stack) -> list[Block]:
    """The Blocks of a stack: its list, or the one Block holding stacked weights."""
    return [stack.layers] if stack.scan_layers else list(stack.layers)
