"""Token, position and segment embeddings as NNX modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from tfx.nn import axes
from tfx.ops import _checks
from tfx.ops.positional import sinusoidal

__all__ = ["LearnedPositions", "SinusoidalPositions", "TokenEmbedding"]


class TokenEmbedding(nnx.Module):
    """A [vocab_size, d_model] table; also the tied output projection (`attend`).

    Args:
      vocab_size: rows of the table.
      d_model: width of each row.
      one_hot: compute the lookup as one_hot(ids) @ table, the matrix view of embedding used in
        teaching; the default gather gives the same numbers without the [.., vocab] one-hot.
      init_std: standard deviation of the normal initialisation (GPT-2 / BERT use 0.02).
      vocab_axis: logical axis of the table's rows (tfx.nn.axes): axes.VOCAB for tokens, None
        (replicated) for a table too small to split, such as BERT's two token types.
    """

    def __init__(self, vocab_size: int, d_model: int, *, one_hot: bool = False,
                 init_std: float = 0.02, vocab_axis: str | None = axes.VOCAB, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.vocab_size, self.one_hot, self.dtype = vocab_size, one_hot, dtype
        init = jax.nn.initializers.normal(init_std)
        self.table = nnx.Param(init(rngs.params(), (vocab_size, d_model), param_dtype),
                               **axes.metadata(vocab_axis, axes.EMBED))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """int [batch, seq] -> [batch, seq, d_model] in the compute dtype."""
        _checks.integer("ids", ids)
        table = self.table[...] if self.dtype is None else self.table[...].astype(self.dtype)
        if self.one_hot:
            return jax.nn.one_hot(ids, self.vocab_size, dtype=table.dtype) @ table
        return jnp.take(_whole_rows(table), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output head: [batch, seq, d_model] -> logits [batch, seq, vocab_size]."""
        table = self.table[...].astype(x.dtype)
        return jnp.einsum("bsd,vd->bsv", x, table)


def _whole_rows(table: jax.Array) -> jax.Array:
    """`table` [rows, d_model] with its d_model dimension gathered on every device, under a
    mesh of `AxisType.Auto` axes (`jax.set_mesh`, the train step's abstract mesh); unchanged
    without one, and under explicit or manual axes, where shardings are the arrays' types.

    FSDP splits the table's d_model over "fsdp", and XLA's partitioner otherwise looks rows
    up in that layout: the embeddings come out split over d_model while every other activation
    is split over the batch, and going between the two (an all-to-all over devices it cannot
    pair up) it does by replicating the whole [batch, seq, d_model] tensor ("Involuntary full
    rematerialization", in the backward pass's scatter). Gathering the table first, as FSDP
    gathers every weight where it is used, makes the lookup of each device's own rows local.
    The rows keep the split the partitioner picks (the vocabulary over "tensor")."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(kind != AxisType.Auto for kind in mesh.axis_types):
        return table
    return jax.lax.with_sharding_constraint(table,
                                            PartitionSpec(PartitionSpec.UNCONSTRAINED, None))


class LearnedPositions(nnx.Module):
    """Learned absolute positions (GPT-2, BERT): a [max_len, d_model] table."""

    def __init__(self, max_len: int, d_model: int, *, init_std: float = 0.02, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.max_len, self.dtype = max_len, dtype
        init = jax.nn.initializers.normal(init_std)
        self.table = nnx.Param(init(rngs.params(), (max_len, d_model), param_dtype),
                               **axes.metadata(None, axes.EMBED))

    def __call__(self, positions: jax.Array) -> jax.Array:
        """int [..., seq] -> [..., seq, d_model]. Positions must be < max_len (checked when
        the length is static: a learned table has no entry beyond its end)."""
        if positions.shape[-1] > self.max_len:
            raise ValueError(f"sequence length {positions.shape[-1]} exceeds the learned position "
                             f"table (max_len={self.max_len})")
        table = self.table[...] if self.dtype is None else self.table[...].astype(self.dtype)
        return jnp.take(table, positions, axis=0)


class SinusoidalPositions(nnx.Module):
    """Fixed sinusoidal positions (Vaswani et al.); no parameters."""

    def __init__(self, d_model: int, *, dtype=None):
        self.d_model, self.dtype = d_model, dtype

    def __call__(self, positions: jax.Array) -> jax.Array:
        out = sinusoidal(positions, self.d_model)
        return out if self.dtype is None else out.astype(self.dtype)
