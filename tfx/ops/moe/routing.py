"""Routing tokens to experts: top-k (Mixtral; Switch at k = 1) and GShard top-2, expert capacity
with drops in priority order, and the load-balancing and router z losses.

Definitions (see REFERENCES.md, "MoE"):
- probabilities p = softmax(logits) over all E experts, in float32;
- "topk": the k most probable experts, weights p renormalised over those k (Mixtral). With
  k = 1 the weight stays p (Switch): renormalised it would be 1, and the router would learn
  nothing from the task loss;
- "gshard": top-2 with renormalised gates g1, g2; the second expert is kept with probability
  min(1, 2·g2), drawn with `rng` (no `rng`: always kept, the deterministic evaluation form);
- "deepseek" (DeepSeek-V3): sigmoid scores s = σ(logits); the k experts with the highest
  s + selection_bias are chosen, and weighted by their s renormalised over the k. The bias
  only selects: `update_selection_bias` moves it by ±rate toward balance after each step
  (auxiliary-loss-free balancing). For the load-balancing loss P uses s / Σ s;
- capacity C = ceil(capacity_factor · tokens · k / E) assignments per expert; the assignments
  are queued first choices before second choices, tokens in `priority` order within a choice
  ("position": sequence order as GShard; "probability": highest top-1 probability first, the
  batch-prioritised routing of V-MoE); an expert takes the first C of its queue and drops the
  rest. A dropped assignment contributes nothing, so the residual connection carries the token;
- load_balancing_loss = E · Σ_i f_i · P_i, f_i the fraction of the tokens·k top-k choices that
  picked expert i, P_i the mean probability of expert i: 1 when balanced, E when collapsed onto
  one expert. (Hugging Face's Mixtral loss scores a balanced router k, not 1.)
- router_z_loss = mean over tokens of logsumexp(logits)² (ST-MoE);
- non-finite logits follow one rule, under every policy, so that weights are never NaN and a
  token's bad logits change no other token's routing: a NaN or -inf logit marks an expert the
  token never chooses (P = 0, and it is left out of the z-loss's logsumexp); a token with
  fewer than k choosable experts leaves its remaining assignments not kept (weight 0, no
  capacity), and a token with none routes nowhere and counts in neither loss, as a masked
  token. +inf logits take softmax's limit: the token's probability is shared equally by its
  +inf experts and the others get 0, so with at least k of them its k weights are equal (1/k
  renormalised); its z-loss is then +inf, the loss's true value. Under "deepseek",
  σ(+inf) = 1 is already finite and needs no rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tfx.ops import _checks

__all__ = ["POLICIES", "PRIORITIES", "Routing", "check_router_kernel", "expert_capacity",
           "expert_load", "route", "router_logits", "update_selection_bias"]

POLICIES = ("topk", "gshard", "deepseek")
PRIORITIES = ("position", "probability")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["expert_ids", "weights", "kept", "slot", "load_balancing_loss",
                                "router_z_loss"],
                   meta_fields=["capacity"])
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes.

    expert_ids: int32 [tokens, k], the chosen experts, most probable first.
    weights: float32 [tokens, k], the combine weights (not zeroed where dropped); finite
      whatever the logits (the module docstring's rule for non-finite logits).
    kept: bool [tokens, k], False where capacity, GShard's random second choice or the token
      mask dropped the assignment.
    slot: int32 [tokens, k], the assignment's place in its expert's queue (priority order);
      kept assignments have slot < capacity.
    capacity: assignments per expert (static int), or None when dropless.
    load_balancing_loss, router_z_loss: float32 scalars.
    """

    expert_ids: jax.Array
    weights: jax.Array
    kept: jax.Array
    slot: jax.Array
    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    capacity: int | None = None


def router_logits(x: jax.Array, router_kernel: jax.Array) -> jax.Array:
    """float32 [tokens, E] = x [tokens, d_model] @ router_kernel [d_model, E], in float32 as
    Switch recommends (the softmax over experts is sensitive to rounding)."""
    check_router_kernel(router_kernel, x.shape[-1])
    return jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32))


def check_router_kernel(router_kernel, d_model: int) -> None:
    """Require a floating [d_model, num_experts] router kernel."""
    _checks.floating("router_kernel", router_kernel, ndim=2, layout="[d_model, num_experts]")
    if router_kernel.shape[0] != d_model:
        raise ValueError(f"router_kernel must be [d_model={d_model}, num_experts], got shape "
                         f"{tuple(router_kernel.shape)}")


def expert_capacity(num_tokens: int, num_experts: int, num_selected: int,
                    capacity_factor: float | None) -> int | None:
    """C = ceil(capacity_factor · num_tokens · num_selected / num_experts); None if dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * num_tokens * num_selected / num_experts))


@functools.partial(jax.jit, static_argnames=("num_selected", "policy", "capacity_factor",
                                             "jitter", "renormalize", "priority"))
def route(router_logits: jax.Array, *, num_selected: int, policy: str = "topk",
          capacity_factor: float | None = None, rng: jax.Array | None = None,
          jitter: float = 0.0, renormalize: bool | None = None, priority: str = "position",
          token_mask: jax.Array | None = None,
          selection_bias: jax.Array | None = None) -> Routing:
    """Route each token to `num_selected` experts.

    Args:
      router_logits: float [tokens, num_experts]; NaN and ±inf entries follow the rule of
        the module docstring (NaN and -inf: never chosen; +inf: softmax's limit).
      num_selected: k, experts per token (2 for "gshard").
      policy: "topk", "gshard" or "deepseek" (see the module docstring).
      capacity_factor: > 0 for a capacity of ceil(cf · tokens · k / E) per expert; None for
        dropless routing.
      rng: key for the random parts (jitter, GShard's second choice); None = deterministic.
      jitter: Switch's multiplicative noise, logits · U(1 − jitter, 1 + jitter), applied to the
        selection (not the z-loss) and only with an `rng`.
      renormalize: divide the k weights by their sum; default True for k > 1, False for k = 1.
      priority: queue order for capacity, "position" or "probability".
      token_mask: optional bool [tokens]; False tokens (padding) route nowhere and count in
        neither loss.
      selection_bias: float [num_experts] added to the scores for choosing only ("deepseek").
    Returns:
      a `Routing`.
    """
    k, token_mask = _check_route(router_logits, num_selected, policy, capacity_factor, jitter,
                                 priority, token_mask, selection_bias)
    tokens, experts = router_logits.shape
    renormalize = k > 1 if renormalize is None else renormalize
    jitter_rng, second_rng = (None, None) if rng is None else jax.random.split(rng)

    logits = router_logits.astype(jnp.float32)
    choosable = logits > -jnp.inf  # False for -inf and NaN: never selected
    # A token with no choosable expert routes nowhere and, like a masked token, counts in
    # neither loss.
    valid = (token_mask & choosable.any(-1)).astype(jnp.float32)
    num_valid = jnp.maximum(valid.sum(), 1.0)
    router_z_loss = _z_loss(logits, choosable, valid) / num_valid
    if jitter and jitter_rng is not None:
        logits = logits * jax.random.uniform(jitter_rng, logits.shape, jnp.float32,
                                             minval=1.0 - jitter, maxval=1.0 + jitter)
    probs, top, expert_ids = _choose(logits, choosable, k, policy, selection_bias)
    chosen = jnp.take_along_axis(choosable, expert_ids, axis=-1)
    weights = top / _nonzero(top.sum(-1, keepdims=True)) if renormalize else top

    choices = jax.nn.one_hot(expert_ids, experts, dtype=jnp.float32) * (
        valid[:, None] * chosen)[..., None]
    fraction = choices.sum((0, 1)) / (num_valid * k)
    mean_prob = (probs * valid[:, None]).sum(0) / num_valid
    load_balancing_loss = experts * jnp.sum(fraction * mean_prob)

    selected = token_mask[:, None] & chosen
    if policy == "gshard" and second_rng is not None:
        keep_second = 2.0 * weights[:, 1] > jax.random.uniform(second_rng, (tokens,), jnp.float32)
        selected = selected.at[:, 1].set(selected[:, 1] & keep_second)
    capacity = expert_capacity(tokens, experts, k, capacity_factor)
    slot = _queue_slots(expert_ids, selected, top[:, 0], experts, priority)
    kept = selected if capacity is None else selected & (slot < capacity)
    return Routing(expert_ids=expert_ids.astype(jnp.int32), weights=weights, kept=kept,
                   slot=slot, load_balancing_loss=load_balancing_loss,
                   router_z_loss=router_z_loss, capacity=capacity)


def _check_route(router_logits, num_selected, policy, capacity_factor, jitter, priority,
                 token_mask, selection_bias) -> tuple[int, jax.Array]:
    """Validate `route`'s arguments; returns (k, the token mask, all True when None)."""
    _checks.floating("router_logits", router_logits, ndim=2, layout="[tokens, num_experts]")
    tokens, experts = router_logits.shape
    if experts < 1:
        raise ValueError(f"router_logits must have num_experts >= 1, got shape "
                         f"{tuple(router_logits.shape)}")
    k = _checks.positive_int("num_selected", num_selected)
    if k > experts:
        raise ValueError(f"num_selected ({k}) must be <= num_experts ({experts})")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "gshard" and k != 2:
        raise ValueError(f"policy 'gshard' routes to 2 experts: num_selected must be 2, got {k}")
    if capacity_factor is not None:
        _checks.positive_float("capacity_factor", capacity_factor)
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    if selection_bias is not None:
        if policy != "deepseek":
            raise ValueError(f"selection_bias is for policy 'deepseek', got policy {policy!r}")
        _checks.floating("selection_bias", selection_bias, ndim=1, layout="[num_experts]")
        if selection_bias.shape != (experts,):
            raise ValueError(f"selection_bias must be [num_experts] = ({experts},), got shape "
                             f"{tuple(selection_bias.shape)}")
    if token_mask is None:
        return k, jnp.ones((tokens,), bool)
    _checks.boolean("token_mask", token_mask)
    if token_mask.shape != (tokens,):
        raise ValueError(f"token_mask must be bool [tokens] = ({tokens},), got shape "
                         f"{tuple(token_mask.shape)}")
    return k, token_mask


def _z_loss(logits, choosable, valid) -> jax.Array:
    """Σ over valid tokens of logsumexp² of their choosable logits (ST-MoE's z-loss, unscaled)."""
    has_expert = choosable.any(-1, keepdims=True)
    # A token without a choosable expert (never valid) reads zeros, so that its logsumexp is
    # finite and the discarded branch gives no NaN gradient.
    masked = jnp.where(choosable, logits, jnp.where(has_expert, -jnp.inf, 0.0))
    log_sum_exp = jax.nn.logsumexp(masked, axis=-1)
    return jnp.where(valid > 0, log_sum_exp**2, 0.0).sum()


def _nonzero(x: jax.Array) -> jax.Array:
    """x with zeros replaced by 1: a divisor for sums that are 0 only when every term is."""
    return jnp.where(x > 0, x, 1.0)


def _choose(logits, choosable, k: int, policy: str, selection_bias):
    """(P [tokens, E]: the probabilities of the load-balancing loss, the chosen experts'
    weights before renormalisation [tokens, k], their ids [tokens, k]). Experts that are not
    `choosable` get P = 0 and rank below every choosable one (they are chosen only where a
    token has fewer than k choosable experts, and then not kept)."""
    if policy != "deepseek":
        probs = _softmax_limit(logits, choosable)
        ranking, weights = logits, probs  # by logit: probabilities that underflow to 0 still rank
    else:
        # The inner where keeps NaN out of the sigmoid's gradient (0 · σ'(NaN) = NaN).
        scores = jnp.where(choosable, jax.nn.sigmoid(jnp.where(choosable, logits, 0.0)), 0.0)
        probs = scores / _nonzero(scores.sum(-1, keepdims=True))
        ranking = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
        weights = scores
    _, expert_ids = jax.lax.top_k(jnp.where(choosable, ranking, -jnp.inf), k)
    return probs, jnp.take_along_axis(weights, expert_ids, axis=-1), expert_ids


def _softmax_limit(logits, choosable):
    """float32 [tokens, E]: softmax over each token's choosable experts (0 for the others; all 0
    when none is). Where some logits are +inf it is softmax's limit: equal shares for the +inf
    experts, 0 for the rest."""
    infinite = choosable & (logits == jnp.inf)
    finite = choosable & (logits < jnp.inf)
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(finite, logits, -jnp.inf), -1, keepdims=True))
    # The inner where keeps inf - inf and NaN out of exp and out of its gradient.
    exp = jnp.where(finite, jnp.exp(jnp.where(finite, logits - shift, 0.0)), 0.0)
    softmax = exp / _nonzero(exp.sum(-1, keepdims=True))
    count = infinite.sum(-1, keepdims=True, dtype=jnp.float32)  # float32 also under x64
    shares = infinite / jnp.maximum(count, 1.0)
    return jnp.where(infinite.any(-1, keepdims=True), shares, softmax)


def expert_load(routing: Routing, num_experts: int) -> jax.Array:
    """float32 [num_experts]: each expert's share of the kept assignments (sums to 1, or to 0
    when nothing was kept)."""
    counts = jnp.zeros((num_experts,), jnp.float32).at[routing.expert_ids].add(
        routing.kept.astype(jnp.float32))
    return counts / jnp.maximum(counts.sum(), 1.0)


def update_selection_bias(selection_bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias_i + rate · sign(mean load − load_i),
    raising the bias of underloaded experts and lowering that of overloaded ones.
    selection_bias, load: [..., num_experts] (load as from `expert_load`)."""
    mean = load.mean(-1, keepdims=True)
    return selection_bias + rate * jnp.sign(mean - load).astype(selection_bias.dtype)


def _queue_slots(expert_ids, selected, top_prob, experts: int, priority: str) -> jax.Array:
    """Each selected assignment's 0-based place in its expert's queue: choice by choice, tokens
    in sequence order or by descending top-1 probability. int32 [tokens, k]."""
    tokens, k = expert_ids.shape
    order = (jnp.arange(tokens) if priority == "position"
             else jnp.argsort(-top_prob, stable=True))
    # [k, tokens] in queue order: first choices of every token, then second choices, ...
    queued = jax.nn.one_hot(expert_ids[order].T, experts, dtype=jnp.int32)
    queued = queued * selected[order].T[..., None].astype(jnp.int32)
    place = jnp.cumsum(queued.reshape(k * tokens, experts), axis=0).reshape(queued.shape) - 1
    place = jnp.take_along_axis(place, expert_ids[order].T[..., None], axis=-1)[..., 0]
    return jnp.zeros((tokens, k), jnp.int32).at[order].set(place.T)
