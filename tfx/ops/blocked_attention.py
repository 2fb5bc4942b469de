"""Blocked (flash-style) attention: online softmax over tiles, O(T + S) memory, skipped tiles.

Forward (Rabe & Staats 2021; Dao et al. 2022): for each query block, loop over the key blocks
that the static block plan says hold a visible pair, keeping a running max, a running sum and a
running output in float32; the [T, S] score matrix never exists. The custom VJP saves only the
output and the per-row log-sum-exp, and the backward pass recomputes each visited tile to get
dQ, dK, dV (and d bias) in one sweep. Tiles outside the plan cost nothing in either pass.

Arrays inside this module use the grouped, head-major layout the tiles are cut from:
query [B, K, G, T, D], key [B, K, S, D], value [B, K, S, Dv], bias and mask [b, k, g, t, s]
with every dim either full or 1 (K = num_kv_heads, G = num_heads // num_kv_heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops.block_plan import BlockPlan

__all__ = ["blocked_attention"]

_MASKED_LOGIT = float(np.finfo(np.float32).min)


def blocked_attention(query, key, value, bias, mask, *, plan: BlockPlan, scale: float,
                      block_q: int, block_k: int):
    """Attention over padded, grouped arrays following `plan`.

    Args:
      query: [B, K, G, T, D] with T a multiple of block_q.
      key: [B, K, S, D] and value [B, K, S, Dv] with S a multiple of block_k.
      bias: None or float [b, k, g, t, s] broadcastable to [B, K, G, T, S] (t, s full or 1).
      mask: None or bool of the same kind; True = may attend.
      plan: the static tiles to visit (`tfx.ops.block_plan.block_plan`).
    Returns:
      float32 [B, K, G, T, Dv]; rows with no visible key are zeros.
    """
    kernel = _Kernel(plan, scale, block_q, block_k)
    return kernel.attend(query, key, value, bias, mask)


class _Kernel:
    """The static configuration of one blocked attention, and its forward and backward sweeps."""

    def __init__(self, plan: BlockPlan, scale: float, block_q: int, block_k: int):
        self.plan, self.scale, self.block_q, self.block_k = plan, scale, block_q, block_k
        self.attend = jax.custom_vjp(self._attend)
        self.attend.defvjp(self._forward, self._backward)

    # Tiles ------------------------------------------------------------------------------------

    def _slice(self, x, axis: int, block: int, size: int):
        if x.shape[axis] == 1:
            return x
        return jax.lax.dynamic_slice_in_dim(x, block * size, size, axis=axis)

    def _visit(self, query_block, visit):
        """(key block index, static tile mask) of the `visit`-th tile of a query block."""
        key_block = jnp.asarray(self.plan.key_blocks)[query_block, visit]
        tile_mask = jnp.asarray(self.plan.tile_masks)[
            jnp.asarray(self.plan.tile_mask_ids)[query_block, visit]
        ]
        return key_block, tile_mask

    def _scores(self, q_tile, key, bias, mask, query_block, visit):
        """Scaled, biased, masked float32 scores of one tile, with its visibility."""
        key_block, visible = self._visit(query_block, visit)
        k_tile = self._slice(key, 2, key_block, self.block_k)
        scores = jnp.einsum("bkgqd,bksd->bkgqs", q_tile, k_tile,
                            preferred_element_type=jnp.float32) * jnp.float32(self.scale)
        if bias is not None:
            bias_tile = self._slice(self._slice(bias, 3, query_block, self.block_q), 4, key_block,
                                    self.block_k)
            scores = scores + bias_tile.astype(jnp.float32)
        if mask is not None:
            mask_tile = self._slice(self._slice(mask, 3, query_block, self.block_q), 4, key_block,
                                    self.block_k)
            visible = visible & mask_tile
        return jnp.where(visible, scores, _MASKED_LOGIT), visible, key_block, k_tile

    # Forward ----------------------------------------------------------------------------------

    def _attend(self, query, key, value, bias, mask):
        return self._forward(query, key, value, bias, mask)[0]

    def _forward(self, query, key, value, bias, mask):
        batch, heads, group, q_len, _ = query.shape
        value_dim = value.shape[-1]
        rows = (batch, heads, group, self.block_q)

        def query_block(qb):
            q_tile = self._slice(query, 3, qb, self.block_q)

            def visit(i, carry):
                row_max, row_sum, acc = carry
                scores, visible, key_block, _ = self._scores(q_tile, key, bias, mask, qb, i)
                v_tile = self._slice(value, 2, key_block, self.block_k)
                new_max = jnp.maximum(row_max, scores.max(axis=-1))
                probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
                correction = jnp.exp(row_max - new_max)
                row_sum = row_sum * correction + probs.sum(axis=-1)
                acc = acc * correction[..., None] + jnp.einsum(
                    "bkgqs,bksd->bkgqd", probs.astype(value.dtype), v_tile,
                    preferred_element_type=jnp.float32)
                return new_max, row_sum, acc

            init = (jnp.full(rows, _MASKED_LOGIT), jnp.zeros(rows),
                    jnp.zeros((*rows, value_dim)))
            row_max, row_sum, acc = jax.lax.fori_loop(
                0, jnp.asarray(self.plan.visits)[qb], visit, init)
            has_keys = row_sum > 0.0
            out = acc / jnp.where(has_keys, row_sum, 1.0)[..., None]
            log_sum_exp = jnp.where(has_keys, row_max + jnp.log(jnp.where(has_keys, row_sum, 1.0)),
                                    0.0)
            return out, log_sum_exp

        num_q_blocks = q_len // self.block_q
        out, log_sum_exp = jax.lax.map(query_block, jnp.arange(num_q_blocks))
        # [nq, B, K, G, bq, ...] -> [B, K, G, T, ...]
        out = jnp.moveaxis(out, 0, 3).reshape(batch, heads, group, q_len, value_dim)
        log_sum_exp = jnp.moveaxis(log_sum_exp, 0, 3).reshape(batch, heads, group, q_len)
        return out, (query, key, value, bias, mask, out, log_sum_exp)

    # Backward ---------------------------------------------------------------------------------

    def _backward(self, residuals, d_out):
        query, key, value, bias, mask, out, log_sum_exp = residuals
        d_out = d_out.astype(jnp.float32)
        # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij, the softmax Jacobian's row term.
        delta = jnp.sum(d_out * out, axis=-1)
        f32 = functools.partial(jnp.zeros_like, dtype=jnp.float32)
        init = (f32(key), f32(value), None if bias is None else f32(bias))

        def query_block(carry, qb):
            d_key, d_value, d_bias = carry
            q_tile = self._slice(query, 3, qb, self.block_q)
            do_tile = self._slice(d_out, 3, qb, self.block_q)
            lse_tile = self._slice(log_sum_exp, 3, qb, self.block_q)[..., None]
            delta_tile = self._slice(delta, 3, qb, self.block_q)[..., None]

            def visit(i, inner):
                d_query, d_key, d_value, d_bias = inner
                scores, visible, key_block, k_tile = self._scores(q_tile, key, bias, mask, qb, i)
                v_tile = self._slice(value, 2, key_block, self.block_k)
                probs = jnp.where(visible, jnp.exp(scores - lse_tile), 0.0)
                d_probs = jnp.einsum("bkgqd,bksd->bkgqs", do_tile, v_tile,
                                     preferred_element_type=jnp.float32)
                d_scores = probs * (d_probs - delta_tile)
                d_value = _add_block(d_value, key_block, self.block_k, jnp.einsum(
                    "bkgqs,bkgqd->bksd", probs, do_tile))
                d_logits = d_scores * jnp.float32(self.scale)
                d_query = d_query + jnp.einsum("bkgqs,bksd->bkgqd", d_logits,
                                               k_tile.astype(jnp.float32))
                d_key = _add_block(d_key, key_block, self.block_k, jnp.einsum(
                    "bkgqs,bkgqd->bksd", d_logits, q_tile.astype(jnp.float32)))
                if d_bias is not None:
                    d_bias = _add_bias_tile(d_bias, d_scores, qb, key_block, self.block_q,
                                            self.block_k)
                return d_query, d_key, d_value, d_bias

            d_query = jnp.zeros(q_tile.shape, jnp.float32)
            d_query, d_key, d_value, d_bias = jax.lax.fori_loop(
                0, jnp.asarray(self.plan.visits)[qb], visit, (d_query, d_key, d_value, d_bias))
            return (d_key, d_value, d_bias), d_query

        batch, heads, group, q_len, head_dim = query.shape
        (d_key, d_value, d_bias), d_query = jax.lax.scan(
            query_block, init, jnp.arange(q_len // self.block_q))
        d_query = jnp.moveaxis(d_query, 0, 3).reshape(query.shape)
        d_bias = None if bias is None else d_bias.astype(bias.dtype)
        return (d_query.astype(query.dtype), d_key.astype(key.dtype),
                d_value.astype(value.dtype), d_bias, None)


def _accumulate(total, update, starts):
    """total[starts : starts + update.shape] += update (in place under XLA's loop buffers)."""
    current = jax.lax.dynamic_slice(total, starts, update.shape)
    return jax.lax.dynamic_update_slice(total, current + update, starts)


def _add_block(total, block, size, update):
    """Add a [B, K, size, D] tile into [B, K, S, D] at key block `block`."""
    return _accumulate(total, update, (0, 0, block * size, 0))


def _add_bias_tile(d_bias, d_scores, query_block, key_block, block_q, block_k):
    """Add a tile's score gradient into a bias gradient that may broadcast along any dim."""
    broadcast_axes = tuple(a for a in range(5) if d_bias.shape[a] == 1)
    update = d_scores.sum(axis=broadcast_axes, keepdims=True)
    starts = (0, 0, 0,
              query_block * block_q if d_bias.shape[3] != 1 else 0,
              key_block * block_k if d_bias.shape[4] != 1 else 0)
    return _accumulate(d_bias, update, starts)
