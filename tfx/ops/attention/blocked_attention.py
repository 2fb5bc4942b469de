"""Blocked (flash-style) attention: online softmax over tiles, O(T + S) memory, skipped tiles.

Forward (Rabe & Staats 2021; Dao et al. 2022): for each query block, loop over the key blocks
that the static block plan says hold a visible pair, keeping a running max, a running sum and a
running output in float32; the [T, S] score matrix never exists. The custom VJP saves only the
output and the per-row log-sum-exp, and the backward pass recomputes each visited tile to get
dQ, dK, dV (and d bias) in one sweep. Tiles outside the plan cost nothing in either pass, and a
tile that the dynamic mask (a boolean mask or segment ids) leaves empty for the whole batch is
skipped by a branch.

Logit soft-capping (Gemma 2) caps each score q·k as softcap·tanh(q·k / softcap) before the bias
and the mask; the backward pass carries dS through the cap with its derivative 1 - tanh².

Arrays inside this module use the grouped, head-major layout the tiles are cut from:
query [B, K, G, T, D], key [B, K, S, D], value [B, K, S, Dv], bias and mask [b, k, g, t, s]
with every dim either full or 1 (K = num_kv_heads, G = num_heads // num_kv_heads), segment ids
[B, T] and [B, S].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import activations
from tfx.ops.attention.block_plan import BlockPlan

__all__ = ["BLOCK_K", "BLOCK_Q", "NO_KEYS_LOG_SUM_EXP", "ScoreInputs", "blocked_attention",
           "blocked_attention_backward", "blocked_attention_forward", "soft_cap"]

# Default tile sizes (measured with benchmarks/attention.py): tfx.ops.attention's blocked path
# and the chunk pairs of tfx.ops.attention.context_parallel.
BLOCK_Q = 256
BLOCK_K = 512
# Invisible pairs score -inf, while the running max starts at the most negative finite float:
# exp(score - max) is then exactly 0 for every invisible pair, with no second mask and no
# inf - inf, and a row that sees no key keeps a zero sum.
_ROW_MAX_INIT = float(np.finfo(np.float32).min)
# The log-sum-exp of a row that sees no key: the most negative finite float32, so that merging
# partial results weighs it exp(NO_KEYS - lse) = 0 and the backward's exp(-inf - lse) stays 0.
NO_KEYS_LOG_SUM_EXP = _ROW_MAX_INIT


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreInputs:
    """What shapes the scores besides Q and K; any field may be None.

    bias: float [b, k, g, t, s]; mask: bool [b, k, g, t, s] (True = may attend);
    query_segments: int [B, T] and key_segments: int [B, S] (attend within a segment only);
    sinks: float32 [K, G], each head's sink logit: a key with a zero value that every query
    sees (GPT-OSS), so a row's weights may sum to less than one.
    """

    bias: jax.Array | None = None
    mask: jax.Array | None = None
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    sinks: jax.Array | None = None


def soft_cap(scores: jax.Array, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """Logit soft-capping (Gemma 2): scores squashed smoothly into (-softcap, softcap).

    Args:
      scores: float32 scaled scores q·k·scale, any shape, before bias and mask.
      softcap: a float > 0, or None for no cap.
    Returns:
      (softcap·tanh(scores / softcap), its derivative 1 - tanh(scores / softcap)²), both of
      the shape and dtype of scores; (scores, None) when softcap is None.
    """
    if softcap is None:
        return scores, None
    capped = activations.softcap(scores, softcap)
    tanh = capped / jnp.asarray(softcap, scores.dtype)
    return capped, 1.0 - tanh * tanh


def blocked_attention(query, key, value, inputs: ScoreInputs, *, plan: BlockPlan, block_q: int,
                      block_k: int, softcap: float | None = None):
    """Attention over padded, grouped arrays following `plan`.

    Args:
      query: [B, K, G, T, D] with T a multiple of block_q, already multiplied by the score scale
        (once per query rather than once per score).
      key: [B, K, S, D] and value [B, K, S, Dv] with S a multiple of block_k.
      inputs: bias, mask and segment ids, already padded to T and S.
      plan: the static tiles to visit (`tfx.ops.attention.block_plan.block_plan`).
      softcap: None, or a float > 0 that caps the scaled scores s = q·k at softcap·tanh(s /
        softcap) before the bias and the mask are applied.
    Returns:
      float32 [B, K, G, T, Dv]; rows with no visible key are zeros.
    """
    return _Kernel(plan, block_q, block_k, softcap).attend(query, key, value, inputs)


def blocked_attention_forward(query, key, value, inputs: ScoreInputs, *, plan: BlockPlan,
                              block_q: int, block_k: int, softcap: float | None = None):
    """`blocked_attention` with its softmax statistics, to merge with other key sets' results.

    Args: as `blocked_attention`.
    Returns:
      (out float32 [B, K, G, T, Dv], log_sum_exp float32 [B, K, G, T]); a row with no visible
      key has out 0 and log_sum_exp NO_KEYS_LOG_SUM_EXP. Not differentiable: pair it with
      `blocked_attention_backward`.
    """
    out, residuals = _Kernel(plan, block_q, block_k, softcap).forward(query, key, value, inputs)
    return out, residuals[-1]


def blocked_attention_backward(query, key, value, inputs: ScoreInputs, out, log_sum_exp, d_out,
                               *, plan: BlockPlan, block_q: int, block_k: int,
                               softcap: float | None = None):
    """Gradients of one key set's share of an attention whose rows may span other key sets.

    Args:
      query: as in `blocked_attention_forward`.
      key: as in `blocked_attention_forward`.
      value: as in `blocked_attention_forward`.
      inputs: as in `blocked_attention_forward`.
      plan: as in `blocked_attention_forward`.
      block_q: as in `blocked_attention_forward`.
      block_k: as in `blocked_attention_forward`.
      softcap: as in `blocked_attention_forward`.
      out: float32 [B, K, G, T, Dv], the output of the *whole* attention (every key set).
      log_sum_exp: float32 [B, K, G, T], its softmax normaliser over every key set.
      d_out: [B, K, G, T, Dv], the gradient of `out`.
    Returns:
      float32 (d_query [B, K, G, T, D], d_key [B, K, S, D], d_value [B, K, S, Dv]) through
      these keys: summed over the key sets they give the full gradients (ring attention).
    """
    kernel = _Kernel(plan, block_q, block_k, softcap)
    d_query, d_key, d_value, _ = kernel.gradients(
        (query, key, value, inputs, out, log_sum_exp), d_out)
    return d_query, d_key, d_value


class _Kernel:
    """The static configuration of one blocked attention, and its forward and backward sweeps."""

    def __init__(self, plan: BlockPlan, block_q: int, block_k: int, softcap: float | None):
        self.plan, self.block_q, self.block_k = plan, block_q, block_k
        self.softcap = softcap
        self.attend = jax.custom_vjp(self._attend)
        self.attend.defvjp(self.forward, self._backward)

    # Tiles ------------------------------------------------------------------------------------

    def _rows(self, x, query_block, axis=3):
        """The query-block slice of `x` along `axis` (unchanged where that dim is 1)."""
        return _slice(x, axis, query_block * self.block_q, self.block_q)

    def _cols(self, x, key_block, axis):
        return _slice(x, axis, key_block * self.block_k, self.block_k)

    def _loop(self, query_block, visit, carry):
        """Fold `visit(key_block, tile_mask, carry)` over the tiles the plan gives a query block.

        Fully visible tiles come first and run without a static tile mask (None), so only the
        tiles that the causal diagonal, a sparse pattern or key padding cut through pay for it.
        """
        plan = self.plan

        def step(i, carry, partial):
            key_block = jnp.asarray(plan.key_blocks)[query_block, i]
            tile_mask = None
            if partial:
                tile_id = jnp.asarray(plan.tile_mask_ids)[query_block, i]
                tile_mask = jax.lax.dynamic_index_in_dim(jnp.asarray(plan.tile_masks), tile_id,
                                                         keepdims=False)
            return visit(key_block, tile_mask, carry)

        full = jnp.asarray(plan.full_visits)[query_block]
        carry = jax.lax.fori_loop(0, full, functools.partial(step, partial=False), carry)
        return jax.lax.fori_loop(full, jnp.asarray(plan.visits)[query_block],
                                 functools.partial(step, partial=True), carry)

    def _visibility(self, inputs: ScoreInputs, query_block, key_block, tile_mask):
        """The tile's visibility as bool broadcastable to [B, K, G, bq, bk] (None = all), and
        whether it comes from dynamic inputs (then an empty tile is skipped at run time)."""
        visible = []
        if inputs.mask is not None:
            visible.append(self._cols(self._rows(inputs.mask, query_block), key_block, 4))
        if inputs.query_segments is not None:
            q_seg = self._rows(inputs.query_segments, query_block, axis=1)
            k_seg = self._cols(inputs.key_segments, key_block, axis=1)
            visible.append((q_seg[:, :, None] == k_seg[:, None, :])[:, None, None])
        dynamic = bool(visible)
        if tile_mask is not None:
            visible.append(tile_mask)
        return (functools.reduce(jnp.logical_and, visible) if visible else None), dynamic

    def _scores(self, q_tile, k_tile, inputs: ScoreInputs, query_block, key_block, visible,
                transposed=False):
        """Capped, biased float32 scores of one tile, -inf for invisible pairs, and the
        derivative of the cap at each score (None without a cap).

        Both [B, K, G, bq, bk], or [B, K, G, bk, bq] when `transposed` (the backward pass works
        on the transposed tile so that its two largest products need no transposed copies).
        """
        pattern = "bksd,bkgqd->bkgsq" if transposed else "bkgqd,bksd->bkgqs"
        operands = (k_tile, q_tile) if transposed else (q_tile, k_tile)
        scores = jnp.einsum(pattern, *operands, preferred_element_type=jnp.float32)
        # The cap's derivative is kept now: the bias shifts the capped scores below.
        scores, cap_slope = soft_cap(scores, self.softcap)
        flip = (lambda x: jnp.swapaxes(x, -1, -2)) if transposed else (lambda x: x)
        if inputs.bias is not None:
            bias_tile = self._cols(self._rows(inputs.bias, query_block), key_block, 4)
            scores = scores + flip(bias_tile).astype(jnp.float32)
        if visible is not None:
            scores = jnp.where(flip(visible), scores, -jnp.inf)
        return scores, cap_slope


    def _each_tile(self, inputs, query_block, compute, carry):
        """Fold `compute(key_block, visible, carry)` over the planned tiles of a query block,
        skipping tiles that dynamic masks leave empty for the whole batch."""

        def visit(key_block, tile_mask, carry):
            visible, dynamic = self._visibility(inputs, query_block, key_block, tile_mask)
            if not dynamic:
                return compute(key_block, visible, carry)
            return jax.lax.cond(jnp.any(visible), lambda c: compute(key_block, visible, c),
                                lambda c: c, carry)

        return self._loop(query_block, visit, carry)

    # Forward ----------------------------------------------------------------------------------

    def _attend(self, query, key, value, inputs):
        return self.forward(query, key, value, inputs)[0]

    def forward(self, query, key, value, inputs):
        batch, heads, group, q_len, _ = query.shape
        rows = (batch, heads, group, self.block_q)

        def query_block(qb):
            q_tile = self._rows(query, qb)

            def compute(key_block, visible, carry):
                row_max, row_sum, acc = carry
                k_tile, v_tile = self._cols(key, key_block, 2), self._cols(value, key_block, 2)
                scores, _ = self._scores(q_tile, k_tile, inputs, qb, key_block, visible)
                new_max = jnp.maximum(row_max, scores.max(axis=-1))
                probs = jnp.exp(scores - new_max[..., None])
                correction = jnp.exp(row_max - new_max)
                row_sum = row_sum * correction + probs.sum(axis=-1)
                acc = acc * correction[..., None] + jnp.einsum(
                    "bkgqs,bksd->bkgqd", probs.astype(value.dtype), v_tile,
                    preferred_element_type=jnp.float32)
                return new_max, row_sum, acc

            # Explicit float32: under jax_enable_x64 a bare jnp.zeros would be float64, and the
            # branches of the tile-skipping `cond` must return the same dtypes. A sink starts
            # the online softmax: its score is the first max, its weight exp(0) the first sum.
            init = (jnp.full(rows, _ROW_MAX_INIT, jnp.float32), jnp.zeros(rows, jnp.float32),
                    jnp.zeros((*rows, value.shape[-1]), jnp.float32))
            if inputs.sinks is not None:
                sink = jnp.broadcast_to(inputs.sinks[:, :, None], rows)
                init = (sink, jnp.ones(rows, jnp.float32), init[2])
            row_max, row_sum, acc = self._each_tile(inputs, qb, compute, init)
            has_keys = row_sum > 0.0
            safe_sum = jnp.where(has_keys, row_sum, 1.0)
            log_sum_exp = jnp.where(has_keys, row_max + jnp.log(safe_sum), NO_KEYS_LOG_SUM_EXP)
            return acc / safe_sum[..., None], log_sum_exp

        out, log_sum_exp = jax.lax.map(query_block, _block_indices(q_len // self.block_q))
        out, log_sum_exp = _unblock(out), _unblock(log_sum_exp)
        return out, (query, key, value, inputs, out, log_sum_exp)

    # Backward ---------------------------------------------------------------------------------

    def _backward(self, residuals, d_out):
        query, key, value, inputs = residuals[:4]
        d_query, d_key, d_value, d_bias = self.gradients(residuals, d_out)
        bias, sinks = inputs.bias, inputs.sinks
        d_inputs = ScoreInputs(bias=None if bias is None else d_bias.astype(bias.dtype),
                               sinks=None if sinks is None else _sink_gradient(residuals, d_out))
        return (d_query.astype(query.dtype), d_key.astype(key.dtype),
                d_value.astype(value.dtype), d_inputs)

    def gradients(self, residuals, d_out):
        """float32 (d_query, d_key, d_value, d_bias or None) from the forward's residuals."""
        query, key, value, inputs, out, log_sum_exp = residuals
        d_out = d_out.astype(jnp.float32)
        # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij, the row term of the softmax Jacobian.
        delta = jnp.sum(d_out * out, axis=-1)
        zeros = functools.partial(jnp.zeros_like, dtype=jnp.float32)
        bias = inputs.bias

        def query_block(carry, qb):
            q_tile, do_tile = self._rows(query, qb), self._rows(d_out, qb)
            lse_tile = self._rows(log_sum_exp, qb)[..., None, :]
            delta_tile = self._rows(delta, qb)[..., None, :]

            def compute(key_block, visible, carry):
                # Transposed tiles [B, K, G, bk, bq]: P^T, dP^T and dS^T.
                d_query, d_key, d_value, d_bias = carry
                k_tile, v_tile = self._cols(key, key_block, 2), self._cols(value, key_block, 2)
                scores, cap_slope = self._scores(q_tile, k_tile, inputs, qb, key_block, visible,
                                                 transposed=True)
                probs = jnp.exp(scores - lse_tile)  # lse is finite, so invisible pairs give 0
                d_probs = jnp.einsum("bksd,bkgqd->bkgsq", v_tile, do_tile,
                                     preferred_element_type=jnp.float32)
                d_scores = probs * (d_probs - delta_tile)
                if d_bias is not None:  # the bias is added after the cap: it gets dS itself
                    d_bias = self._add_bias_tile(d_bias, jnp.swapaxes(d_scores, -1, -2), qb,
                                                 key_block)
                if cap_slope is not None:  # back through the cap to q·k
                    d_scores = d_scores * cap_slope
                key_start = (0, 0, key_block * self.block_k, 0)
                d_value = _accumulate(d_value, jnp.einsum("bkgsq,bkgqd->bksd", probs, do_tile),
                                      key_start)
                d_key = _accumulate(d_key, jnp.einsum(
                    "bkgsq,bkgqd->bksd", d_scores, q_tile.astype(jnp.float32)), key_start)
                d_query = d_query + jnp.einsum("bkgsq,bksd->bkgqd", d_scores,
                                               k_tile.astype(jnp.float32))
                return d_query, d_key, d_value, d_bias

            d_key, d_value, d_bias = carry
            d_query, d_key, d_value, d_bias = self._each_tile(
                inputs, qb, compute, (zeros(q_tile), d_key, d_value, d_bias))
            return (d_key, d_value, d_bias), d_query

        init = (zeros(key), zeros(value), None if bias is None else zeros(bias))
        (d_key, d_value, d_bias), d_query = jax.lax.scan(
            query_block, init, _block_indices(query.shape[3] // self.block_q))
        return _unblock(d_query), d_key, d_value, d_bias

    def _add_bias_tile(self, d_bias, d_scores, query_block, key_block):
        """Add a tile's score gradient into a bias gradient that may broadcast along any dim."""
        update = d_scores.sum(axis=tuple(a for a in range(5) if d_bias.shape[a] == 1),
                              keepdims=True)
        starts = (0, 0, 0,
                  query_block * self.block_q if d_bias.shape[3] != 1 else 0,
                  key_block * self.block_k if d_bias.shape[4] != 1 else 0)
        return _accumulate(d_bias, update, starts)


def _sink_gradient(residuals, d_out) -> jax.Array:
    """float32 [K, G]: the gradient of each head's sink logit s. Its softmax weight is
    p = exp(s - lse) and its value zero, so dL/ds = -Σ_rows p · (dO · O)."""
    sinks, out, log_sum_exp = residuals[3].sinks, residuals[4], residuals[5]
    delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1)
    weight = jnp.exp(sinks[None, :, :, None] - log_sum_exp)
    return -jnp.sum(weight * delta, axis=(0, 3))


def _slice(x, axis: int, start, size: int):
    """x[..., start : start + size, ...] along `axis`, or x itself where that dim is 1."""
    if x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _unblock(x):
    """[num_q_blocks, B, K, G, bq, ...] from a loop over query blocks -> [B, K, G, T, ...]."""
    x = jnp.moveaxis(x, 0, 3)
    return x.reshape(*x.shape[:3], -1, *x.shape[5:])


def _block_indices(num_blocks: int) -> jax.Array:
    """int32 [num_blocks]: block indices of the same int type as the plan's tables, also under
    jax_enable_x64 (where a bare arange is int64 and dynamic slices refuse mixed index types)."""
    return jnp.arange(num_blocks, dtype=jnp.int32)


def _accumulate(total, update, starts):
    """total[starts : starts + update.shape] += update (in place in XLA's loop buffers)."""
    starts = tuple(jnp.asarray(start, jnp.int32) for start in starts)  # one index type (x64)
    current = jax.lax.dynamic_slice(total, starts, update.shape)
    return jax.lax.dynamic_update_slice(total, current + update, starts)
