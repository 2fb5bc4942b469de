"""Tests for tfx.ops.moe.route against values computed by hand and formulas written out here.

References: Switch Transformer (load-balancing loss E·Σ f_i·P_i, balanced = 1, collapsed = E;
top-1 weight = the router probability), ST-MoE (z-loss = mean logsumexp², (ln E)² for zero
logits), GShard (top-2, second expert kept with probability min(1, 2·g2), first choices take
capacity before second choices), Mixtral (top-2 weights = softmax over the two top logits),
DeepSeek-V3 (group-limited routing, routed_scaling_factor) and Qwen3-MoE (norm_topk_prob)
written out in numpy and checked against transformers' routers where it is installed.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops.moe import (
    check_routing_options,
    expert_capacity,
    expert_load,
    route,
    router_logits,
    update_selection_bias,
)


def _logits_preferring(experts_of_tokens, num_experts, strength=20.0):
    """Logits where token t strongly prefers expert experts_of_tokens[t]."""
    return jnp.asarray(strength * np.eye(num_experts)[np.asarray(experts_of_tokens)],
                       jnp.float32)


class TestLosses:
    def test_balanced_load_scores_one(self):
        logits = _logits_preferring(np.arange(32) % 8, 8)
        routing = route(logits, num_selected=1)
        np.testing.assert_allclose(routing.load_balancing_loss, 1.0, rtol=1e-6)

    def test_uniform_probabilities_score_one_whatever_the_choice(self):
        # P_i = 1/E for every expert, so E·Σ f_i/E = Σ f_i = 1.
        routing = route(jnp.zeros((10, 4)), num_selected=2)
        np.testing.assert_allclose(routing.load_balancing_loss, 1.0, rtol=1e-6)

    @pytest.mark.parametrize("num_experts", [2, 4, 16])
    def test_collapsed_router_scores_num_experts(self, num_experts):
        routing = route(_logits_preferring(np.zeros(12, int), num_experts, 50.0),
                        num_selected=1)
        np.testing.assert_allclose(routing.load_balancing_loss, num_experts, rtol=1e-5)

    def test_load_balancing_formula(self):
        logits = jax.random.normal(jax.random.key(0), (20, 5))
        routing = route(logits, num_selected=2)
        probs = np.asarray(jax.nn.softmax(logits))
        top2 = np.argsort(-probs, axis=1)[:, :2]
        f = np.bincount(top2.ravel(), minlength=5) / (20 * 2)
        expected = 5 * np.sum(f * probs.mean(0))
        np.testing.assert_allclose(routing.load_balancing_loss, expected, rtol=1e-5)

    @pytest.mark.parametrize("num_experts", [2, 8, 64])
    def test_z_loss_of_zero_logits_is_log_e_squared(self, num_experts):
        routing = route(jnp.zeros((6, num_experts)), num_selected=1)
        np.testing.assert_allclose(routing.router_z_loss, math.log(num_experts) ** 2, rtol=1e-6)

    def test_z_loss_formula(self):
        logits = 3.0 * jax.random.normal(jax.random.key(1), (7, 6))
        lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
        routing = route(logits, num_selected=2)
        np.testing.assert_allclose(routing.router_z_loss, np.mean(lse**2), rtol=1e-5)

    def test_losses_have_gradients(self):
        logits = jax.random.normal(jax.random.key(2), (16, 4))

        def total(x):
            r = route(x, num_selected=2)
            return r.load_balancing_loss + r.router_z_loss + r.weights.sum()

        grad = jax.grad(total)(logits)
        assert np.all(np.isfinite(grad)) and np.abs(grad).sum() > 0


class TestTopK(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_weights_are_renormalised_top_k_probabilities(self):
        logits = jax.random.normal(jax.random.key(3), (9, 6))
        routing = self.variant(lambda x: route(x, num_selected=3))(logits)
        probs = np.asarray(jax.nn.softmax(logits))
        order = np.argsort(-probs, axis=1)[:, :3]
        top = np.take_along_axis(probs, order, 1)
        np.testing.assert_array_equal(routing.expert_ids, order)
        np.testing.assert_allclose(routing.weights, top / top.sum(1, keepdims=True), rtol=1e-5)
        chex.assert_type([routing.expert_ids, routing.weights], [jnp.int32, jnp.float32])
        chex.assert_shape([routing.expert_ids, routing.weights, routing.kept, routing.slot],
                          (9, 3))
        assert routing.kept.all() and routing.capacity is None

    def test_mixtral_top2_equals_softmax_over_the_two_logits(self):
        logits = jax.random.normal(jax.random.key(4), (11, 8))
        routing = route(logits, num_selected=2)
        chosen = np.take_along_axis(np.asarray(logits), np.asarray(routing.expert_ids), 1)
        np.testing.assert_allclose(routing.weights, jax.nn.softmax(chosen), rtol=1e-5)

    def test_switch_top1_weight_is_the_probability(self):
        logits = jax.random.normal(jax.random.key(5), (8, 4))
        routing = route(logits, num_selected=1)
        np.testing.assert_allclose(routing.weights[:, 0], jax.nn.softmax(logits).max(1),
                                   rtol=1e-6)
        forced = route(logits, num_selected=1, renormalize=True)
        np.testing.assert_allclose(forced.weights, 1.0)

    def test_router_computes_in_float32(self):
        logits = jax.random.normal(jax.random.key(6), (8, 4)).astype(jnp.bfloat16)
        routing = route(logits, num_selected=2)
        chex.assert_type(routing.weights, jnp.float32)


class TestCapacity:
    def test_capacity_formula(self):
        assert expert_capacity(8192, 64, 2, 1.25) == 320
        assert expert_capacity(10, 4, 1, 1.0) == 3  # ceil(2.5)
        assert expert_capacity(10, 4, 1, None) is None

    def test_keeps_the_first_c_tokens_by_position(self):
        # 8 tokens all want expert 0; C = ceil(1.0 · 8 · 1 / 4) = 2.
        routing = route(_logits_preferring(np.zeros(8, int), 4), num_selected=1,
                        capacity_factor=1.0)
        assert routing.capacity == 2
        np.testing.assert_array_equal(routing.slot[:, 0], np.arange(8))
        np.testing.assert_array_equal(routing.kept[:, 0], np.arange(8) < 2)

    def test_first_choices_take_slots_before_second_choices(self):
        # Two experts, k = 2: tokens 0, 2, 3 prefer expert 0, token 1 prefers expert 1.
        # C = ceil(0.5 · 4 · 2 / 2) = 2. Expert 0's queue: first choices 0, 2, 3, then token 1;
        # expert 1's queue: token 1, then the second choices of tokens 0, 2, 3.
        logits = jnp.asarray([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 0.0]])
        routing = route(logits, num_selected=2, capacity_factor=0.5)
        assert routing.capacity == 2
        np.testing.assert_array_equal(routing.expert_ids, [[0, 1], [1, 0], [0, 1], [0, 1]])
        np.testing.assert_array_equal(routing.slot, [[0, 1], [0, 3], [1, 2], [2, 3]])
        np.testing.assert_array_equal(routing.kept, [[True, True], [True, False],
                                                     [True, False], [False, False]])

    def test_batch_prioritised_routing_keeps_the_most_confident(self):
        strength = jnp.asarray([1.0, 5.0, 2.0, 9.0, 3.0, 0.5])
        logits = jnp.stack([strength, jnp.zeros(6)], 1)  # all prefer expert 0, some more
        routing = route(logits, num_selected=1, capacity_factor=2 / 3, priority="probability")
        assert routing.capacity == 2  # ceil(2/3 · 6 / 2)
        np.testing.assert_array_equal(routing.kept[:, 0], [0, 1, 0, 1, 0, 0])

    def test_dropless_keeps_everything(self):
        logits = _logits_preferring(np.zeros(50, int), 4)
        assert route(logits, num_selected=2).kept.all()

    def test_token_mask_routes_nowhere_and_leaves_the_losses(self):
        logits = jax.random.normal(jax.random.key(7), (12, 4))
        mask = jnp.arange(12) < 9
        routing = route(logits, num_selected=2, capacity_factor=1.0, token_mask=mask)
        alone = route(logits[:9], num_selected=2)
        assert not routing.kept[9:].any()
        np.testing.assert_allclose(routing.load_balancing_loss, alone.load_balancing_loss,
                                   rtol=1e-6)
        np.testing.assert_allclose(routing.router_z_loss, alone.router_z_loss, rtol=1e-6)
        # Padding takes no capacity: the real tokens get the same slots as alone.
        np.testing.assert_array_equal(routing.slot[:9], alone.slot)


class TestRandomness:
    def test_gshard_keeps_the_second_expert_with_probability_two_g2(self):
        logits = jax.random.normal(jax.random.key(8), (20000, 8))
        routing = route(logits, num_selected=2, policy="gshard", rng=jax.random.key(9))
        expected = np.mean(np.minimum(1.0, 2.0 * np.asarray(routing.weights[:, 1])))
        np.testing.assert_allclose(routing.kept[:, 1].mean(), expected, atol=0.01)
        assert routing.kept[:, 0].all()
        assert route(logits, num_selected=2, policy="gshard").kept.all()  # no rng: keep all

    def test_gshard_dropped_second_choices_take_no_capacity(self):
        logits = jax.random.normal(jax.random.key(10), (64, 4))
        routing = route(logits, num_selected=2, policy="gshard", rng=jax.random.key(0),
                        capacity_factor=4.0)
        selected = np.asarray(routing.kept)  # capacity 64: nothing dropped but randomly
        for expert in range(4):
            slots = np.asarray(routing.slot)[selected & (np.asarray(routing.expert_ids) == expert)]
            np.testing.assert_array_equal(np.sort(slots), np.arange(len(slots)))

    def test_jitter_changes_the_choice_only_with_a_key(self):
        logits = jnp.zeros((256, 4)) + 1e-3 * jax.random.normal(jax.random.key(11), (256, 4))
        plain = route(logits, num_selected=1, jitter=0.5)
        np.testing.assert_array_equal(plain.expert_ids, route(logits, num_selected=1).expert_ids)
        noisy = route(logits + 1.0, num_selected=1, jitter=0.5, rng=jax.random.key(12))
        assert (noisy.expert_ids != plain.expert_ids).any()
        np.testing.assert_allclose(noisy.router_z_loss,
                                   route(logits + 1.0, num_selected=1).router_z_loss)


class TestDeepSeek:
    def test_sigmoid_scores_renormalised_over_the_chosen(self):
        logits = jax.random.normal(jax.random.key(13), (10, 6))
        routing = route(logits, num_selected=2, policy="deepseek")
        scores = np.asarray(jax.nn.sigmoid(logits))
        order = np.argsort(-scores, axis=1)[:, :2]
        top = np.take_along_axis(scores, order, 1)
        np.testing.assert_array_equal(routing.expert_ids, order)
        np.testing.assert_allclose(routing.weights, top / top.sum(1, keepdims=True), rtol=1e-5)
        # The load-balancing loss takes P from the scores normalised over the experts.
        f = np.bincount(order.ravel(), minlength=6) / 20
        expected = 6 * np.sum(f * (scores / scores.sum(1, keepdims=True)).mean(0))
        np.testing.assert_allclose(routing.load_balancing_loss, expected, rtol=1e-5)

    def test_the_bias_selects_but_does_not_weigh(self):
        logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
        bias = jnp.asarray([0.0, 0.0, 0.0, 5.0])
        routing = route(logits, num_selected=2, policy="deepseek", selection_bias=bias)
        np.testing.assert_array_equal(routing.expert_ids, [[3, 0]])
        s = jax.nn.sigmoid(logits[0])
        np.testing.assert_allclose(routing.weights[0], jnp.stack([s[3], s[0]]) / (s[3] + s[0]),
                                   rtol=1e-6)

    def test_bias_updates_balance_the_load(self):
        # Step rule: bias_i += rate · sign(mean load − load_i).
        np.testing.assert_allclose(
            update_selection_bias(jnp.zeros(4), jnp.asarray([0.5, 0.25, 0.25, 0.0]), 0.1),
            [-0.1, 0.0, 0.0, 0.1])
        logits = (jax.random.normal(jax.random.key(14), (64, 8))
                  + 0.3 * jnp.arange(8))  # skewed toward the last experts
        bias = jnp.zeros(8)
        before = expert_load(route(logits, num_selected=2, policy="deepseek"), 8)
        for _ in range(300):
            load = expert_load(route(logits, num_selected=2, policy="deepseek",
                                     selection_bias=bias), 8)
            bias = update_selection_bias(bias, load, 0.01)
        assert before.max() > 0.25 and load.max() < 0.16
        np.testing.assert_allclose(load.sum(), 1.0, rtol=1e-6)


class TestBadInput:
    @pytest.mark.parametrize("kwargs, message", [
        (dict(num_selected=5), "num_selected"),
        (dict(num_selected=0), "num_selected"),
        (dict(num_selected=1, capacity_factor=0.0), "capacity_factor"),
        (dict(num_selected=1, capacity_factor=-1.0), "capacity_factor"),
        (dict(num_selected=1, policy="expert_choice"), "policy"),
        (dict(num_selected=1, policy="gshard"), "gshard"),
        (dict(num_selected=1, jitter=1.5), "jitter"),
        (dict(num_selected=1, priority="random"), "priority"),
    ])
    def test_bad_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            route(jnp.zeros((3, 4)), **kwargs)

    @pytest.mark.parametrize("shape", [(4,), (2, 3, 4)])
    def test_logits_of_the_wrong_rank(self, shape):
        with pytest.raises(ValueError, match="router_logits"):
            route(jnp.zeros(shape), num_selected=1)

    def test_selection_bias_outside_deepseek_or_of_the_wrong_shape(self):
        with pytest.raises(ValueError, match="selection_bias is for policy 'deepseek'"):
            route(jnp.zeros((3, 4)), num_selected=1, selection_bias=jnp.zeros(4))
        with pytest.raises(ValueError, match="selection_bias must be"):
            route(jnp.zeros((3, 4)), num_selected=1, policy="deepseek",
                  selection_bias=jnp.zeros(5))

    def test_token_mask_of_the_wrong_shape(self):
        with pytest.raises(ValueError, match="token_mask"):
            route(jnp.zeros((3, 4)), num_selected=1, token_mask=jnp.ones((4,), bool))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _deepseek_reference(logits, bias, k, num_groups, groups_per_token, *, renormalize=True,
                        routed_scale=1.0, fill=-np.inf):
    """DeepSeek-V3's router written out: (ids [T, k] sorted, weights [T, k] in that order).
    Selection scores s + b; a group scores the sum of its two best; outside the token's
    groups_per_token best groups the selection scores become `fill`; the top k of those, each
    weighted by its s (renormalised over the k when asked) times routed_scale."""
    scores = _sigmoid(logits)
    select = scores + np.asarray(bias, np.float64)
    tokens, experts = select.shape
    grouped = select.reshape(tokens, num_groups, -1)
    group_scores = -np.sort(-grouped, -1)[..., :2].sum(-1)
    best = np.argsort(-group_scores, -1, kind="stable")[:, :groups_per_token]
    allowed = np.zeros((tokens, num_groups), bool)
    np.put_along_axis(allowed, best, True, -1)
    select = np.where(np.repeat(allowed, experts // num_groups, -1), select, fill)
    ids = np.sort(np.argsort(-select, -1, kind="stable")[:, :k], -1)
    weights = np.take_along_axis(scores, ids, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return ids, weights * routed_scale


def _by_expert(routing):
    """(ids, weights) of a Routing with each token's k choices sorted by expert id."""
    ids = np.asarray(routing.expert_ids)
    order = np.argsort(ids, -1)
    return (np.take_along_axis(ids, order, -1),
            np.take_along_axis(np.asarray(routing.weights), order, -1))


def _deepseek(logits, bias, k, num_groups, groups_per_token, **kwargs):
    return route(jnp.asarray(logits, jnp.float32), num_selected=k, policy="deepseek",
                 selection_bias=jnp.asarray(bias, jnp.float32), num_groups=num_groups,
                 groups_per_token=groups_per_token, **kwargs)


# logits 0 (s = 1/2) and these biases give selection scores [0.9, -0.1 | -0.5, -0.5]: group 0
# wins (0.8 > -1.0) but its second expert scores below 0, so that a fill of 0.0 for group 1
# (older ports) would pick expert 2 or 3 in its place; -inf keeps the choice inside group 0.
NEGATIVE_BIAS = np.asarray([0.4, -0.6, -1.0, -1.0])


class TestGroupLimited:
    @pytest.mark.parametrize("experts, groups, per_token, k", [
        (8, 4, 2, 2), (12, 3, 1, 4), (16, 8, 3, 6), (6, 6, 3, 2), (8, 1, 1, 3)])
    @pytest.mark.parametrize("renormalize", [True, False])
    def test_matches_the_formula(self, experts, groups, per_token, k, renormalize):
        keys = jax.random.split(jax.random.key(20), 2)
        logits = 2.0 * jax.random.normal(keys[0], (24, experts))
        bias = 0.5 * jax.random.normal(keys[1], (experts,))
        routing = _deepseek(logits, bias, k, groups, per_token, renormalize=renormalize,
                            routed_scale=2.5)
        ids, weights = _deepseek_reference(logits, bias, k, groups, per_token,
                                           renormalize=renormalize, routed_scale=2.5)
        ours_ids, ours_weights = _by_expert(routing)
        np.testing.assert_array_equal(ours_ids, ids)
        np.testing.assert_allclose(ours_weights, weights, rtol=1e-5)
        assert routing.kept.all()

    def test_the_limit_changes_the_choice(self):
        # σ = [.95, .05 | .73, .73]: expert 0 is the best alone, but group 1 (1.46) beats
        # group 0 (1.0), so one group per token means experts 2 and 3.
        logits = jnp.asarray([[3.0, -3.0, 1.0, 1.0]])
        free = _deepseek(logits, np.zeros(4), 2, 1, 1)
        limited = _deepseek(logits, np.zeros(4), 2, 2, 1)
        assert 0 in np.asarray(free.expert_ids)
        np.testing.assert_array_equal(_by_expert(limited)[0], [[2, 3]])
        assert (_by_expert(_deepseek(logits, np.zeros(4), 2, 2, 2))[0] ==
                np.sort(np.asarray(free.expert_ids), -1)).all()  # both groups: no limit

    def test_outside_experts_rank_at_minus_inf_not_zero(self):
        logits = np.zeros((1, 4))
        routing = _deepseek(logits, NEGATIVE_BIAS, 2, 2, 1)
        np.testing.assert_array_equal(_by_expert(routing)[0], [[0, 1]])
        np.testing.assert_array_equal(_deepseek_reference(logits, NEGATIVE_BIAS, 2, 2, 1)[0],
                                      [[0, 1]])
        zero_fill = _deepseek_reference(logits, NEGATIVE_BIAS, 2, 2, 1, fill=0.0)[0]
        assert 1 not in zero_fill  # what a 0.0 fill would have done

    def test_load_balancing_loss_counts_all_experts(self):
        logits = jax.random.normal(jax.random.key(21), (32, 8))
        routing = _deepseek(logits, np.zeros(8), 2, 4, 1)
        ids, _ = _deepseek_reference(logits, np.zeros(8), 2, 4, 1)
        scores = _sigmoid(logits)
        f = np.bincount(ids.ravel(), minlength=8) / (32 * 2)
        expected = 8 * np.sum(f * (scores / scores.sum(1, keepdims=True)).mean(0))
        np.testing.assert_allclose(routing.load_balancing_loss, expected, rtol=1e-5)

        def total(x):
            r = _deepseek(x, np.zeros(8), 2, 4, 1, routed_scale=2.5)
            return r.load_balancing_loss + r.router_z_loss + r.weights.sum()

        grad = jax.grad(total)(logits)
        assert np.all(np.isfinite(grad)) and np.abs(grad).sum() > 0

    def test_non_finite_logits_keep_the_rule(self):
        # A group with a NaN or -inf among its two best scores -inf. Token 0 loses group 0 and
        # its best expert; token 1 has group 2 only; token 2 has a single choosable expert,
        # in a group that scores -inf like all the others, so it has no place among the
        # groups (the first by index win the tie): it routes nowhere.
        logits = np.asarray([[5.0, np.nan, 1.0, 0.5, 0.0, -1.0],
                             [-np.inf, -np.inf, np.nan, 0.5, 0.0, -1.0],
                             [np.nan, np.nan, np.nan, np.nan, 1.0, np.nan]])
        routing = _deepseek(logits, np.zeros(6), 2, 3, 1)
        assert np.isfinite(np.asarray(routing.weights)).all()
        np.testing.assert_array_equal(_by_expert(routing)[0][:2], [[2, 3], [4, 5]])
        np.testing.assert_array_equal(routing.kept, [[True, True], [True, True],
                                                     [False, False]])
        np.testing.assert_array_equal(routing.weights[2], [0.0, 0.0])
        assert np.isfinite(float(routing.load_balancing_loss))


class TestScaleAndRenormalize:
    @pytest.mark.parametrize("policy, k", [("topk", 2), ("gshard", 2), ("deepseek", 3)])
    def test_routed_scale_multiplies_the_weights_only(self, policy, k):
        logits = jax.random.normal(jax.random.key(22), (16, 6))
        plain = route(logits, num_selected=k, policy=policy, capacity_factor=1.0,
                      rng=jax.random.key(1))
        scaled = route(logits, num_selected=k, policy=policy, capacity_factor=1.0,
                       rng=jax.random.key(1), routed_scale=2.5)
        np.testing.assert_allclose(scaled.weights, 2.5 * np.asarray(plain.weights), rtol=1e-6)
        for field in ("expert_ids", "kept", "slot", "load_balancing_loss", "router_z_loss"):
            np.testing.assert_array_equal(getattr(scaled, field), getattr(plain, field))

    def test_qwen3_without_renormalisation_keeps_the_probabilities(self):
        logits = jax.random.normal(jax.random.key(23), (10, 8))
        routing = route(logits, num_selected=3, renormalize=False)
        probs = np.asarray(jax.nn.softmax(logits))
        top = -np.sort(-probs, -1)[:, :3]
        np.testing.assert_allclose(routing.weights, top, rtol=1e-5)
        assert (np.asarray(routing.weights).sum(-1) < 1.0).all()

    def test_deepseek_without_renormalisation_keeps_the_sigmoids(self):
        logits = jax.random.normal(jax.random.key(24), (10, 8))
        routing = route(logits, num_selected=2, policy="deepseek", renormalize=False,
                        routed_scale=2.0)
        top = -np.sort(-_sigmoid(logits), -1)[:, :2]
        np.testing.assert_allclose(routing.weights, 2.0 * top, rtol=1e-5)


class TestGroupOptionsBadInput:
    @pytest.mark.parametrize("kwargs, message", [
        (dict(num_groups=3), "num_groups .3. must divide num_experts .8."),
        (dict(num_groups=0), "num_groups"),
        (dict(num_groups=4, groups_per_token=5), "groups_per_token .5. must be <= num_groups"),
        (dict(num_groups=4, groups_per_token=0), "groups_per_token"),
        (dict(num_groups=4, groups_per_token=1, num_selected=3), "num_selected .3. must be <="),
        (dict(num_groups=2, policy="topk"), "policy 'deepseek'"),
        (dict(routed_scale=0.0), "routed_scale"),
        (dict(routed_scale=-1.0), "routed_scale"),
        (dict(routed_scale=float("inf")), "routed_scale"),
    ])
    def test_bad_options(self, kwargs, message):
        kwargs = dict(dict(num_selected=2, policy="deepseek"), **kwargs)
        with pytest.raises(ValueError, match=message):
            route(jnp.zeros((3, 8)), **kwargs)
        with pytest.raises(ValueError, match=message):
            check_routing_options(8, **kwargs)


def _hf_deepseek_router(experts, k, groups, per_token, renormalize, scale, seed=0):
    """transformers' DeepseekV3TopkRouter with random weights and bias (None without torch)."""
    torch = pytest.importorskip("torch")
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = deepseek.DeepseekV3Config(hidden_size=8, n_routed_experts=experts,
                                       num_experts_per_tok=k, n_group=groups,
                                       topk_group=per_token, norm_topk_prob=renormalize,
                                       routed_scaling_factor=scale)
    router = deepseek.DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 8, generator=generator))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(experts, generator=generator))
    return router


class TestAgainstTransformers:
    @pytest.mark.parametrize("experts, k, groups, per_token", [(16, 4, 4, 2), (8, 2, 4, 3),
                                                               (12, 3, 3, 1)])
    @pytest.mark.parametrize("renormalize", [True, False])
    def test_deepseek_v3_router(self, experts, k, groups, per_token, renormalize):
        torch = pytest.importorskip("torch")
        router = _hf_deepseek_router(experts, k, groups, per_token, renormalize, 2.5)
        x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _, hf_weights, hf_ids = router(x)
        order = hf_ids.argsort(-1)
        kernel = jnp.asarray(router.weight.detach().numpy().T)
        routing = _deepseek(router_logits(jnp.asarray(x.numpy()), kernel),
                            router.e_score_correction_bias.numpy(), k, groups, per_token,
                            renormalize=renormalize, routed_scale=2.5)
        ids, weights = _by_expert(routing)
        np.testing.assert_array_equal(ids, hf_ids.gather(1, order).numpy())
        np.testing.assert_allclose(weights, hf_weights.gather(1, order).numpy(), rtol=1e-5)

    def test_deepseek_v3_router_with_negative_selection_scores(self):
        torch = pytest.importorskip("torch")
        router = _hf_deepseek_router(4, 2, 2, 1, True, 1.0)
        with torch.no_grad():
            router.weight.zero_()  # logits 0, s = 1/2
            router.e_score_correction_bias.copy_(torch.tensor(NEGATIVE_BIAS))
            _, _, hf_ids = router(torch.ones(1, 8))
        np.testing.assert_array_equal(hf_ids.sort(-1).values.numpy(), [[0, 1]])

    @pytest.mark.parametrize("renormalize", [True, False])
    def test_qwen3_moe_router(self, renormalize):
        torch = pytest.importorskip("torch")
        qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
        config = qwen.Qwen3MoeConfig(hidden_size=8, num_experts=8, num_experts_per_tok=3,
                                     norm_topk_prob=renormalize)
        router = qwen.Qwen3MoeTopKRouter(config)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            router.weight.copy_(torch.randn(8, 8, generator=generator))
            x = torch.randn(40, 8, generator=generator)
            _, hf_weights, hf_ids = router(x)
        kernel = jnp.asarray(router.weight.detach().numpy().T)
        routing = route(router_logits(jnp.asarray(x.numpy()), kernel), num_selected=3,
                        renormalize=renormalize)
        np.testing.assert_array_equal(routing.expert_ids, hf_ids.numpy())
        np.testing.assert_allclose(routing.weights, hf_weights.numpy(), rtol=1e-5)
