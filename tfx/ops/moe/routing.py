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
- group-limited routing ("deepseek" only; DeepSeek-V3's node-limited routing, n_group and
  topk_group): the E experts form `num_groups` equal groups of consecutive ids; a group scores
  the sum of its two highest s + selection_bias (its one, for groups of one expert), and each
  token chooses its k experts among those of its `groups_per_token` best groups only. The
  other experts rank at -inf, as in DeepSeek's reference code and transformers'
  DeepseekV3TopkRouter (earlier ports filled 0.0, which lets an outside expert win wherever
  the bias makes a chosen group's s + bias <= 0). P, and so the load-balancing loss, still
  covers all E experts: it measures the router, not the limit;
- weights: renormalised over the k when `renormalize` (transformers' norm_topk_prob: True
  for DeepSeek-V3, whose sum gets + 1e-20, far below float32's resolution of a sum of
  sigmoids; Qwen3-MoE's default False keeps the top-k probabilities), then times
  `routed_scale` (DeepSeek-V3's routed_scaling_factor, 2.5);
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
  σ(+inf) = 1 is already finite and needs no rule; with groups, a group with fewer than two
  choosable experts scores -inf (the sum's value), so it is among the token's groups only
  where better groups are too few.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from tfx import names
from tfx.ops import _checks
from tfx.ops._pytree import static_field

__all__ = ["POLICIES", "PRIORITIES", "Routing", "check_router_kernel", "check_routing_options",
           "expert_capacity", "expert_load", "route", "router_logits", "update_selection_bias"]

POLICIES = names.MOE_POLICIES
PRIORITIES = ("position", "probability")


@jax.tree_util.register_dataclass
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
    capacity: int | None = static_field(None)


def router_logits(x: jax.Array, router_kernel: jax.Array,
                  router_bias: jax.Array | None = None) -> jax.Array:
    """float32 [tokens, E] = x [tokens, d_model] @ router_kernel [d_model, E] (+ router_bias
    [E], GPT-OSS's), in float32 as Switch recommends (the softmax over experts is sensitive to
    rounding)."""
    check_router_kernel(router_kernel, x.shape[-1], router_bias)
    logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32))
    return logits if router_bias is None else logits + router_bias.astype(jnp.float32)


def check_router_kernel(router_kernel, d_model: int, router_bias=None) -> None:
    """Require a floating [d_model, num_experts] router kernel, and a floating [num_experts]
    router bias when one is given."""
    _checks.floating("router_kernel", router_kernel, ndim=2, layout="[d_model, num_experts]")
    if router_kernel.shape[0] != d_model:
        raise ValueError(f"router_kernel must be [d_model={d_model}, num_experts], got shape "
                         f"{tuple(router_kernel.shape)}")
    if router_bias is not None:
        _checks.floating("router_bias", router_bias, ndim=1, layout="[num_experts]")
        if router_bias.shape != router_kernel.shape[1:]:
            raise ValueError(f"router_bias must be [num_experts] = ({router_kernel.shape[1]},), "
                             f"got shape {tuple(router_bias.shape)}")


def expert_capacity(num_tokens: int, num_experts: int, num_selected: int,
                    capacity_factor: float | None) -> int | None:
    """C = ceil(capacity_factor · num_tokens · num_selected / num_experts); None if dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * num_tokens * num_selected / num_experts))


@functools.partial(jax.jit, static_argnames=(
    "num_selected", "policy", "capacity_factor", "jitter", "renormalize", "priority",
    "num_groups", "groups_per_token", "routed_scale"))
def route(router_logits: jax.Array, *, num_selected: int, policy: str = "topk",
          capacity_factor: float | None = None, rng: jax.Array | None = None,
          jitter: float = 0.0, renormalize: bool | None = None, priority: str = "position",
          token_mask: jax.Array | None = None, selection_bias: jax.Array | None = None,
          num_groups: int = 1, groups_per_token: int = 1,
          routed_scale: float = 1.0) -> Routing:
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
      num_groups: experts per token come from `groups_per_token` of `num_groups` equal groups
        ("deepseek" only; the module docstring); 1: no groups.
      groups_per_token: 1 <= groups_per_token <= num_groups, with k <= the experts of
        groups_per_token groups.
      routed_scale: > 0, the factor of the combine weights (after renormalisation).
    Returns:
      a `Routing`.
    """
    token_mask = _check_route_arrays(router_logits, policy, token_mask, selection_bias)
    k = check_routing_options(router_logits.shape[1], num_selected, policy=policy,
                              capacity_factor=capacity_factor, jitter=jitter, priority=priority,
                              num_groups=num_groups, groups_per_token=groups_per_token,
                              routed_scale=routed_scale)
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
    probs, top, expert_ids, chosen = _choose(logits, choosable, k, policy, selection_bias,
                                             num_groups, groups_per_token)
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
    # Scaled last: GShard's second choice reads the unscaled gate.
    return Routing(expert_ids=expert_ids.astype(jnp.int32), weights=weights * routed_scale,
                   kept=kept,
                   slot=slot, load_balancing_loss=load_balancing_loss,
                   router_z_loss=router_z_loss, capacity=capacity)


def check_routing_options(num_experts: int, num_selected: int, *, policy: str = "topk",
                          capacity_factor: float | None = None, jitter: float = 0.0,
                          priority: str = "position", num_groups: int = 1,
                          groups_per_token: int = 1, routed_scale: float = 1.0) -> int:
    """Validate `route`'s static options for `num_experts` experts (a ValueError or TypeError
    that names the argument), before any array exists (tfx.nn.MoE checks at construction);
    returns k = num_selected."""
    k = _checks.positive_int("num_selected", num_selected)
    if k > num_experts:
        raise ValueError(f"num_selected ({k}) must be <= num_experts ({num_experts})")
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
    if not math.isfinite(_checks.positive_float("routed_scale", routed_scale)):
        raise ValueError(f"routed_scale must be finite, got {routed_scale}")
    _check_groups(num_experts, k, policy, num_groups, groups_per_token)
    return k


def _check_groups(num_experts, k, policy, num_groups, groups_per_token) -> None:
    """Validate group-limited routing's options (module docstring)."""
    _checks.positive_int("num_groups", num_groups)
    _checks.positive_int("groups_per_token", groups_per_token)
    if num_groups > 1 and policy != "deepseek":
        raise ValueError(f"num_groups > 1 (group-limited routing) is for policy 'deepseek', got "
                         f"num_groups={num_groups} with policy {policy!r}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
    if groups_per_token > num_groups:
        raise ValueError(f"groups_per_token ({groups_per_token}) must be <= num_groups "
                         f"({num_groups})")
    choosable = groups_per_token * (num_experts // num_groups)
    if k > choosable:
        raise ValueError(f"num_selected ({k}) must be <= the {choosable} experts of "
                         f"groups_per_token={groups_per_token} groups of "
                         f"{num_experts // num_groups}")


def _check_route_arrays(router_logits, policy, token_mask, selection_bias) -> jax.Array:
    """Validate `route`'s arrays; returns the token mask (all True when None)."""
    _checks.floating("router_logits", router_logits, ndim=2, layout="[tokens, num_experts]")
    tokens, experts = router_logits.shape
    if experts < 1:
        raise ValueError(f"router_logits must have num_experts >= 1, got shape "
                         f"{tuple(router_logits.shape)}")
    if selection_bias is not None:
        if policy != "deepseek":
            raise ValueError(f"selection_bias is for policy 'deepseek', got policy {policy!r}")
        _checks.floating("selection_bias", selection_bias, ndim=1, layout="[num_experts]")
        if selection_bias.shape != (experts,):
            raise ValueError(f"selection_bias must be [num_experts] = ({experts},), got shape "
                             f"{tuple(selection_bias.shape)}")
    if token_mask is None:
        return jnp.ones((tokens,), bool)
    _checks.boolean("token_mask", token_mask)
    if token_mask.shape != (tokens,):
        raise ValueError(f"token_mask must be bool [tokens] = ({tokens},), got shape "
                         f"{tuple(token_mask.shape)}")
    return token_mask


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


def _choose(logits, choosable, k: int, policy: str, selection_bias, num_groups: int = 1,
            groups_per_token: int = 1):
    """(P [tokens, E]: the probabilities of the load-balancing loss, the chosen experts'
    weights before renormalisation [tokens, k], their ids [tokens, k], whether each was
    choosable [tokens, k]). Experts that are not `choosable`, or outside the token's best
    groups, get weight 0 and rank below every choosable one (they are chosen only where a token
    has fewer than k choosable experts, and then not kept); P = 0 only for the former."""
    if policy != "deepseek":
        probs = _softmax_limit(logits, choosable)
        ranking, weights = logits, probs  # by logit: probabilities that underflow to 0 still rank
    else:
        # The inner where keeps NaN out of the sigmoid's gradient (0 · σ'(NaN) = NaN).
        scores = jnp.where(choosable, jax.nn.sigmoid(jnp.where(choosable, logits, 0.0)), 0.0)
        probs = scores / _nonzero(scores.sum(-1, keepdims=True))
        ranking = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
        weights = scores
    ranking = jnp.where(choosable, ranking, -jnp.inf)
    if num_groups > 1:
        choosable = choosable & _best_groups(ranking, num_groups, groups_per_token)
        ranking = jnp.where(choosable, ranking, -jnp.inf)
        weights = jnp.where(choosable, weights, 0.0)
    _, expert_ids = jax.lax.top_k(ranking, k)
    chosen = functools.partial(jnp.take_along_axis, indices=expert_ids, axis=-1)
    return probs, chosen(weights), expert_ids, chosen(choosable)


def _best_groups(ranking, num_groups: int, groups_per_token: int) -> jax.Array:
    """bool [tokens, E]: the experts of each token's `groups_per_token` best groups of
    consecutive experts, a group scoring the sum of its two highest `ranking` [tokens, E]
    entries (-inf for experts the token cannot choose)."""
    tokens, experts = ranking.shape
    grouped = ranking.reshape(tokens, num_groups, experts // num_groups)
    best, _ = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))
    _, groups = jax.lax.top_k(best.sum(-1), groups_per_token)
    allowed = jax.nn.one_hot(groups, num_groups, dtype=jnp.int32).sum(1) > 0  # [tokens, G]
    return jnp.repeat(allowed, experts // num_groups, axis=-1)


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
