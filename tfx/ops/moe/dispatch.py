"""Running the experts on their tokens and combining the results.

Four implementations of one function, `experts_ffn`; None (the default) picks this platform's
(tfx.ops.backends: "ragged" on GPU, "megablox" on TPU, "sorted" elsewhere):
- "onehot": GShard's einsums with a [tokens, E, C] dispatch tensor (C = capacity, or tokens
  when dropless). Simple and the reference the others are tested against, but its cost grows
  as tokens · E · C · d_model.
- "sorted": the kept assignments sorted by expert into contiguous groups, each padded to a
  multiple of `block_size` rows, run through `grouped_matmul`, which visits only the blocks in
  use. Capacity only decides which assignments are kept; no row of capacity padding is
  computed, so this path is as fast dropless as with a capacity (benchmarks/moe.py).
- "ragged": the sorted rows (no padding) through `jax.lax.ragged_dot`; on CPU XLA computes every
  expert on every row, so it is here for accelerators and for measuring.
- "megablox": the same rows through the Pallas megablox `gmm` kernel (tfx.ops.moe.megablox):
  TPU only, or anywhere with `interpret=True` (slow, for tests); float32 or bfloat16.

Every implementation runs one expert MLP (`_expert_mlp`), so each takes every expert form:
an activation of tfx.ops.activations.ACTIVATIONS or GPT-OSS's `ClampedSwiGLU`, and the optional
per-expert biases of `ExpertWeights` (added by the expert each row belongs to).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tfx import names
from tfx.ops import _checks
from tfx.ops.activations import ACTIVATIONS
from tfx.ops.backends import current_platform, select_grouped_matmul
from tfx.ops.moe import megablox
from tfx.ops.moe.grouped_matmul import grouped_matmul
from tfx.ops.moe.routing import Routing

__all__ = ["IMPLEMENTATIONS", "ClampedSwiGLU", "ExpertWeights", "batched_experts",
           "check_activation", "check_weights", "combine_rows", "experts_ffn", "gather_rows",
           "grouped_experts", "sorted_rows"]

IMPLEMENTATIONS = names.MOE_DISPATCHES


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Stacked expert MLPs: down(act(gate(x)) * up(x)) when `gate` is given (SwiGLU with silu),
    down(act(up(x))) otherwise. gate, up: [E, d_model, d_ff]; down: [E, d_ff, d_model]; the
    optional biases (GPT-OSS) gate_bias, up_bias: [E, d_ff] (gate_bias only with gate) and
    down_bias: [E, d_model] are added to their projection's output."""

    gate: jax.Array | None
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated expert activation, the `activation` of gated experts: with g = min(gate,
    limit) and u = clip(up, -limit, limit), hidden = (u + 1) · g · σ(alpha · g). The clamps keep
    the product bounded (but for g's negative side, where g · σ(alpha · g) -> 0)."""

    limit: float
    alpha: float

    def __post_init__(self):
        _checks.finite_positive_float("ClampedSwiGLU.limit", self.limit)
        _checks.finite_positive_float("ClampedSwiGLU.alpha", self.alpha)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """gate, up [..., d_ff] -> [..., d_ff]."""
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


@functools.partial(jax.jit, static_argnames=("activation", "implementation", "block_size",
                                             "interpret"))
def experts_ffn(x: jax.Array, routing: Routing, weights: ExpertWeights, *,
                activation: str = "silu", implementation: str | None = None,
                block_size: int = 128, interpret: bool = False) -> jax.Array:
    """Σ_j kept[t, j] · weights[t, j] · expert_{expert_ids[t, j]}(x[t]) for every token t.

    Args:
      x: [tokens, d_model].
      routing: from `route` over the same tokens.
      weights: the experts' matrices (and biases).
      activation: a key of tfx.ops.activations.ACTIVATIONS, or a `ClampedSwiGLU` (gated
        experts).
      implementation: None (this platform's), "sorted", "onehot", "ragged" or "megablox"
        (module docstring).
      block_size: rows per block of "sorted", and the row tile of "megablox".
      interpret: run "megablox" in Pallas interpret mode (on any platform); the other
        implementations are plain XLA and ignore it.
    Returns:
      [tokens, d_model] in x's dtype; zero for a token whose every assignment was dropped.
      Each token's row depends on that token alone: a token with a non-finite x (or an
      expert output that overflows) gets a NaN row when any of its assignments is kept and
      changes no other token's row; a dropped assignment contributes exactly zero.
    """
    if implementation is None:
        implementation = select_grouped_matmul(current_platform())
    _check(x, routing, weights, activation, implementation, interpret)
    _checks.positive_int("block_size", block_size)
    if 0 in x.shape or (weights.up.shape[2] == 0 and weights.down_bias is None):
        return jnp.zeros_like(x)  # no token, feature or hidden unit: sums of nothing
    if weights.up.shape[2] == 0:  # no hidden unit: each kept expert gives its down bias
        return combine_rows(weights.down_bias.astype(x.dtype), routing.expert_ids, routing,
                            x.dtype)
    if implementation == "onehot":
        return _onehot(x, routing, weights, activation)
    if implementation == "sorted":
        return _blocked(x, routing, weights, activation, block_size)
    tokens, k = routing.expert_ids.shape
    rows, destination, sizes = sorted_rows(x, routing, weights.up.shape[0], 1, tokens * k)
    out = grouped_experts(rows, sizes, weights, activation, implementation,
                          tile_rows=block_size, interpret=interpret)
    return combine_rows(out, destination, routing, x.dtype)


def _check(x, routing, weights, activation, implementation, interpret):
    _checks.floating("x", x, ndim=2, layout="[tokens, d_model]")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    if implementation == "megablox":
        megablox.check_available(x.dtype, current_platform(), interpret)
    if routing.expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routing covers {routing.expert_ids.shape[0]} tokens but x has "
                         f"{x.shape[0]}")
    check_weights(weights, x.shape[1])
    check_activation(activation, weights)


def check_activation(activation, weights: ExpertWeights) -> None:
    """ValueError unless `activation` is a key of ACTIVATIONS, or a `ClampedSwiGLU` of experts
    with a gate."""
    if isinstance(activation, ClampedSwiGLU):
        if weights.gate is None:
            raise ValueError("activation ClampedSwiGLU needs gated experts (weights.gate), got "
                             "weights.gate None")
    elif activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a ClampedSwiGLU, "
                         f"got {activation!r}")


def check_weights(weights: ExpertWeights, d_model: int, num_experts: int | None = None) -> None:
    """Require gate/up [E, d_model, d_ff], down [E, d_ff, d_model] and the biases given
    gate_bias/up_bias [E, d_ff], down_bias [E, d_model] (E = num_experts when given, else up's
    leading dim); ValueError naming the field otherwise."""
    _checks.rank("weights.up", weights.up, 3, "[num_experts, d_model, d_ff]")
    experts = weights.up.shape[0] if num_experts is None else num_experts
    d_ff = weights.up.shape[2]
    expected = {"up": (experts, d_model, d_ff), "down": (experts, d_ff, d_model),
                "up_bias": (experts, d_ff), "down_bias": (experts, d_model)}
    if weights.gate is not None:
        expected |= {"gate": expected["up"], "gate_bias": expected["up_bias"]}
    elif weights.gate_bias is not None:
        raise ValueError("weights.gate_bias needs weights.gate (ungated experts have no gate)")
    for name, shape in expected.items():
        value = getattr(weights, name)
        if value is not None and value.shape != shape:
            raise ValueError(f"weights.{name} must have shape {shape} (num_experts, d_model, "
                             f"d_ff), got {tuple(value.shape)}")


def _expert_mlp(rows, weights: ExpertWeights, activation, matmul, per_row):
    """down(act(gate) * up), or down(act(up)) without a gate (a `ClampedSwiGLU` combines gate
    and up itself), where each projection is `matmul(inputs, stacked weight [E, in, out])` plus
    `per_row(bias [E, out])`, the bias of each row's expert laid out as matmul's output: the
    one place the expert MLP is written, for every layout of the rows."""
    def project(inputs, w, bias):
        if w is None:
            return None
        out = matmul(inputs, w.astype(rows.dtype))
        return out if bias is None else out + per_row(bias.astype(out.dtype))

    gate = project(rows, weights.gate, weights.gate_bias)
    up = project(rows, weights.up, weights.up_bias)
    if isinstance(activation, ClampedSwiGLU):
        hidden = activation(gate, up)
    else:
        act = ACTIVATIONS[activation]
        hidden = act(up) if gate is None else act(gate) * up
    return project(hidden, weights.down, weights.down_bias)


def batched_experts(xe, weights: ExpertWeights, activation):
    """Every expert on its own rows: [E, rows, d_model] -> [E, rows, d_model]."""
    return _expert_mlp(xe, weights, activation, lambda a, w: jnp.einsum("eci,eio->eco", a, w),
                       lambda bias: bias[:, None, :])


def combine_rows(rows, destination, routing: Routing, dtype):
    """out[t] = Σ_j kept · weight · rows[destination[t, j]]. rows [R, d]; destination
    int [tokens, k] (any value where not kept).

    Selected with `where`, never multiplied by 0 (0 · NaN = NaN): a dropped assignment gives
    exactly 0 whatever row it would read, and a token with a non-finite kept row gets a NaN
    row (`_poison_tokens`)."""
    kept = routing.kept
    gate = jnp.where(kept, routing.weights, 0.0).astype(dtype)
    picked = jnp.take(rows, jnp.where(kept, destination, 0), axis=0)
    picked = jnp.where(kept[..., None], picked, 0)
    out = jnp.einsum("tk,tkd->td", gate, picked)
    return _poison_tokens(out, (kept & ~jnp.isfinite(picked).all(-1)).any(-1))


def _poison_tokens(out, bad):
    """out [tokens, d] with the rows of the `bad` tokens (bool [tokens]) set to NaN: a token
    whose own expert computation is not finite (non-finite x, or an overflow) gets NaN in every
    implementation, where the einsums of "onehot" would otherwise spread it to every token."""
    return jnp.where(bad[:, None], jnp.nan, out)


def gather_rows(x, destination, kept, num_rows: int):
    """The [num_rows, d] buffer whose row destination[t, j] is x[t] for each kept assignment;
    other rows zero. Built as a gather (its gradient is a scatter-add of rows)."""
    tokens, k = destination.shape
    target = jnp.where(kept, destination, num_rows).reshape(-1)
    source = jnp.full((num_rows,), tokens, jnp.int32).at[target].set(
        jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), k), mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return jnp.take(padded, source, axis=0)


def grouped_experts(rows, group_sizes, weights: ExpertWeights, activation,
                    implementation: str, *, tile_rows: int = 128, interpret: bool = False):
    """Every expert on its own rows, the rows sorted by expert: [R, d_model] -> [R, d_model].

    group_sizes: int32 [E], summing to at most R (the rows after them come out zero).
    implementation: "ragged" (`jax.lax.ragged_dot`) or "megablox" (its `tile_rows` and
    `interpret` as in `grouped_matmul_megablox`)."""
    if implementation == "megablox":
        def matmul(a, w):
            return megablox.grouped_matmul_megablox(a, w, group_sizes, tile_rows=tile_rows,
                                                    interpret=interpret)
    else:
        def matmul(a, w):
            return jax.lax.ragged_dot(a, w, group_sizes)

    def per_row(bias):
        # Row r belongs to the first group ending after it; rows past every group read a zero
        # row, so that they stay zero (every activation maps 0 to 0).
        expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]),
                                  side="right")
        return jnp.concatenate([bias, jnp.zeros_like(bias[:1])])[expert]

    return _expert_mlp(rows, weights, activation, matmul, per_row)


def sorted_rows(x, routing: Routing, experts: int, block: int, num_rows: int):
    """The kept assignments' rows sorted by expert, each expert's group padded to a multiple
    of `block`: (rows [num_rows, d], destination [tokens, k] of each assignment, padded group
    sizes int32 [E])."""
    counts = jnp.zeros((experts,), jnp.int32).at[routing.expert_ids].add(
        routing.kept.astype(jnp.int32))
    sizes = (counts + block - 1) // block * block
    destination = (jnp.cumsum(sizes) - sizes)[routing.expert_ids] + routing.slot
    return gather_rows(x, destination, routing.kept, num_rows), destination, sizes


def block_layout(x, routing: Routing, experts: int, block: int):
    """The rows of "sorted" and how `grouped_matmul` visits them: (rows [num_blocks · block,
    d] sorted by expert, each group padded to a multiple of `block`; destination [tokens, k];
    block_expert int32 [num_blocks], the expert of each block; used int32 [], the blocks that
    hold rows). num_blocks leaves room for any grouping of the tokens · k assignments."""
    tokens, k = routing.expert_ids.shape
    block = min(block, tokens * k)
    num_blocks = -(-(tokens * k + experts * (block - 1)) // block)
    rows, destination, sizes = sorted_rows(x, routing, experts, block, num_blocks * block)
    ends = jnp.cumsum(sizes)
    block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_blocks) * block,
                                                side="right"), experts - 1).astype(jnp.int32)
    return rows, destination, block_expert, (ends[-1] // block).astype(jnp.int32)


def _blocked(x, routing: Routing, weights, activation, block: int):
    rows, destination, block_expert, used = block_layout(x, routing, weights.up.shape[0], block)
    # Padding rows and unused blocks get their block's expert's biases: combine never reads them.
    out = _expert_mlp(rows, weights, activation,
                      lambda a, w: grouped_matmul(a, w, block_expert, used),
                      lambda bias: jnp.repeat(bias[block_expert], rows.shape[0]
                                              // block_expert.shape[0], axis=0))
    return combine_rows(out, destination, routing, x.dtype)


def _onehot(x, routing: Routing, weights, activation):
    experts = weights.up.shape[0]
    tokens = x.shape[0]
    capacity = tokens if routing.capacity is None else routing.capacity
    # [tokens, k, E, C]: assignment (t, j) goes to slot `slot` of expert `expert_ids`.
    place = (jax.nn.one_hot(routing.expert_ids, experts, dtype=x.dtype)[..., None]
             * jax.nn.one_hot(routing.slot, capacity, dtype=x.dtype)[..., None, :])
    place = place * routing.kept[..., None, None].astype(x.dtype)
    dispatch = place.sum(1)
    gate = jnp.where(routing.kept, routing.weights, 0.0).astype(x.dtype)
    combine = jnp.einsum("tkec,tk->tec", place, gate)
    # Both einsums sum over tokens, where one non-finite value times the zeros of the one-hot
    # tensors would make every token NaN: they see finite values only, and the tokens whose
    # own rows are not finite are poisoned afterwards, as a per-token computation gives.
    finite = jnp.isfinite(x)
    xe = jnp.einsum("tec,td->ecd", dispatch, jnp.where(finite, x, 0))
    ye = batched_experts(xe, weights, activation)
    bad_input = jnp.einsum("tec,t->ec", dispatch, (~finite.all(-1)).astype(x.dtype)) > 0
    bad_slot = bad_input | ~jnp.isfinite(ye).all(-1)
    out = jnp.einsum("tec,ecd->td", combine, jnp.where(bad_slot[..., None], 0, ye))
    return _poison_tokens(out, jnp.einsum("tec,ec->t", dispatch, bad_slot.astype(x.dtype)) > 0)
