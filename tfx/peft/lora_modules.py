"""The modules LoRA puts in place of a linear layer or a token embedding.

Each keeps the wrapped module's weights at their paths (`kernel`/`bias`, `table`) and adds two
`PeftParam` factors `lora_a` [..., d_in, rank] and `lora_b` [..., rank, d_out]; the forward adds
scale·(x·a)·b to x·W without ever forming a·b.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn.dropout import make_dropout
from tfx.nn.embeddings import TokenEmbedding
from tfx.peft.core import PeftParam

__all__ = ["LoRAEmbedding", "LoRALinear"]


def _adopt(module: nnx.Module, base: nnx.Module) -> None:
    """Give `module` every public attribute of `base` (its Variables and settings), so the
    inherited forward of base's class runs unchanged on base's weights."""
    for name, value in vars(base).items():
        if not name.startswith("_"):
            setattr(module, name, value)


class LoRALinear(nnx.Linear):
    """An `nnx.Linear` plus a low-rank update: x·W + b + scale·(dropout(x)·a)·b_lora.

    Args:
      base: the linear layer to adapt (its kernel [d_in, d_out] and bias stay, frozen by the
        caller's choice of what to train).
      a: [d_in, rank]; b: [rank, d_out] (with the kernel's leading axes, e.g. [num_layers] for
        stacked layers).
      scale: alpha / rank (or alpha / sqrt(rank) for rsLoRA).
      dropout: rate applied to the input of the low-rank path only (peft's lora_dropout).
    """

    def __init__(self, base: nnx.Linear, a: jax.Array, b: jax.Array, *, scale: float,
                 dropout: float = 0.0, rngs: nnx.Rngs | None = None):
        _adopt(self, base)
        self.lora_a, self.lora_b = PeftParam(a), PeftParam(b)
        self.scale = scale
        self.lora_dropout = make_dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        """[..., d_in] -> [..., d_out]."""
        y = super().__call__(x, out_sharding=out_sharding)
        return y + _low_rank(self.lora_dropout(x), self.lora_a[...], self.lora_b[...],
                             self.scale, y.dtype)


class LoRAEmbedding(TokenEmbedding):
    """A `TokenEmbedding` whose table is table + scale·a·b (a [vocab, rank], b [rank, d_model]),
    looked up as table[ids] + scale·a[ids]·b; the tied output head uses the same sum."""

    def __init__(self, base: TokenEmbedding, a: jax.Array, b: jax.Array, *, scale: float):
        _adopt(self, base)
        self.lora_a, self.lora_b = PeftParam(a), PeftParam(b)
        self.scale = scale

    def __call__(self, ids: jax.Array) -> jax.Array:
        """int [batch, seq] -> [batch, seq, d_model]."""
        x = super().__call__(ids)
        rows = jnp.take(self.lora_a[...], ids, axis=0)
        return x + _low_rank(rows, None, self.lora_b[...], self.scale, x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """[batch, seq, d_model] -> logits [batch, seq, vocab]: x·(table + s·a·b)ᵀ."""
        logits = super().attend(x)
        a, b = self.lora_a[...], self.lora_b[...]
        return logits + _low_rank(x, b.T, a.T, self.scale, logits.dtype)


def _low_rank(x, a, b, scale, dtype) -> jax.Array:
    """scale·(x·a)·b in `dtype`, scaled on the narrow [.., rank] side; a None: x is x·a."""
    h = x.astype(dtype) if a is None else x.astype(dtype) @ a.astype(dtype)
    return (h * jnp.asarray(scale, dtype)) @ b.astype(dtype)
