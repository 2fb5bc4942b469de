"""Projections as one flat matmul: `flat_dot_general`, a drop-in `lax.dot_general` for
`nnx.Linear(dot_general=...)`; `add_bias` and `apply_scale`, whose parameter gradients are
matmuls too.

A projection x[batch, seq, in] · W[in, out] written as one 3-D `dot_general` makes XLA's
backward contract the output gradient over (batch, seq) for W's gradient, and on CPU it copies
that gradient transposed before each such matmul. The same product on x reshaped to
[batch·seq, in] is an ordinary 2-D matmul forward and backward (W's gradient is xᵀ·g), with
fewer copies: the compiled training step of char-gpt holds 91 copies instead of 131, of a 6-layer
GPT-2 169 instead of 223, and in three of four A/B runs the step was faster (char-gpt
1.34-1.49x, gpt-6x384 1.00-1.09x; benchmarks/flat_linear.py). The values are the same products,
summed in the same order.

The bias gradient of y + b is the sum of the output gradient over every row. XLA:CPU without
its YNNPACK fusions (how tfx's training step compiles dense models, see
`tfx.train.step.compiler_options`) rewrites that sum over the [batch·seq] axis into a tree of
`reduce-window` ops fused with the elementwise backward around it: about 16 ms each on the
6-layer/384 GPT's step. `add_bias` computes it as ones[rows] · g[rows, out], one
matrix-vector product: that step went from 1,650-1,720 to 1,850-1,900 tokens/s (same-session
A/B runs; benchmarks/train.py). A norm's learned scale has the same kind of gradient, the sum
of g · x over the rows, and `apply_scale` computes it the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["add_bias", "apply_scale", "flat_dot_general"]


@functools.partial(jax.jit, static_argnames=("dimension_numbers", "precision",
                                             "preferred_element_type", "out_sharding"))
def flat_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                     preferred_element_type=None, out_sharding=None) -> jax.Array:
    """`lax.dot_general`, with a projection lhs [..., in] · rhs [in, out] computed on lhs
    flattened to [prod(...), in] and the result reshaped to [..., out].

    Any other contraction (batch axes, a rhs with more than two axes, a 2-D lhs) and any call
    with `out_sharding` (whose sharding names the unflattened result) goes to `lax.dot_general`
    unchanged.
    """
    kwargs = {"precision": precision, "preferred_element_type": preferred_element_type}
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    projection = (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
                  and not lhs_batch and not rhs_batch and rhs.ndim == 2 and lhs.ndim > 2)
    if not projection or out_sharding is not None:
        return lax.dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding, **kwargs)
    flat = lax.dot_general(lhs.reshape(-1, lhs.shape[-1]), rhs, (((1,), (0,)), ((), ())),
                           **kwargs)
    return flat.reshape(*lhs.shape[:-1], rhs.shape[1])


@jax.custom_vjp
def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """y [..., out] + bias [out] (the same dtype), with the bias gradient computed as one
    matrix-vector product (see the module docstring). Reverse-mode differentiable only."""
    return _add_bias(y, bias)


def _add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    if bias.shape != y.shape[-1:] or bias.dtype != y.dtype:
        raise ValueError(f"add_bias: bias must be [{y.shape[-1]}] of dtype {y.dtype} (y's last "
                         f"axis and dtype), got {bias.shape} {bias.dtype}")
    return y + bias


def _add_bias_fwd(y: jax.Array, bias: jax.Array):
    return _add_bias(y, bias), None


def _add_bias_bwd(_, g: jax.Array):
    return g, _row_sum(g)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


@jax.custom_vjp
def apply_scale(y: jax.Array, scale: jax.Array) -> jax.Array:
    """y [..., features] · scale [features] (the same dtype), a norm's learned scale, with the
    scale gradient Σ_rows g · y computed as one matrix-vector product (module docstring).
    Reverse-mode differentiable only."""
    return _apply_scale(y, scale)


def _apply_scale(y: jax.Array, scale: jax.Array) -> jax.Array:
    if scale.shape != y.shape[-1:] or scale.dtype != y.dtype:
        raise ValueError(f"apply_scale: scale must be [{y.shape[-1]}] of dtype {y.dtype} (y's "
                         f"last axis and dtype), got {scale.shape} {scale.dtype}")
    return y * scale


def _apply_scale_fwd(y: jax.Array, scale: jax.Array):
    return _apply_scale(y, scale), (y, scale)


def _apply_scale_bwd(residuals, g: jax.Array):
    y, scale = residuals
    return g * scale, _row_sum(g * y)


apply_scale.defvjp(_apply_scale_fwd, _apply_scale_bwd)


def _row_sum(g: jax.Array) -> jax.Array:
    """g [..., n] summed over every leading axis, as ones[rows] · g[rows, n], in g's dtype."""
    rows = g.reshape(-1, g.shape[-1])
    ones = jnp.ones((rows.shape[0],), g.dtype)
    # Summed in float32 at least: a bfloat16 running sum drifts; float64 stays float64.
    total_dtype = jnp.promote_types(g.dtype, jnp.float32)
    return jnp.matmul(ones, rows, preferred_element_type=total_dtype).astype(g.dtype)
