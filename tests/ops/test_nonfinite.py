"""Non-finite values stay where they are: in MoE a NaN or inf token changes no other token's
output, non-finite router logits follow the rule of tfx.ops.moe.routing's docstring (NaN and
-inf: never chosen; +inf: softmax's limit) under every policy, and in attention a -inf bias
hides its key exactly as a False mask does, in every implementation that takes a bias."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import expert_weights

from tfx.ops import dot_product_attention
from tfx.ops.moe import IMPLEMENTATIONS, POLICIES, experts_ffn, moe, route

# Every implementation runs on CPU: "megablox" in Pallas interpret mode (the others ignore it).
FFN = {"interpret": True, "block_size": 8}


def _moe_case(tokens=8, experts=4, d_model=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (tokens, d_model))
    logits = jax.random.normal(keys[1], (tokens, experts))
    return x, logits, expert_weights(keys[2], experts, d_model, 8)


class TestExpertsFfn:
    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    @pytest.mark.parametrize("capacity_factor", [None, 0.75])
    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
    def test_a_non_finite_token_changes_no_other_token(self, implementation, capacity_factor,
                                                       bad):
        x, logits, weights = _moe_case()
        routing = route(logits, num_selected=2, capacity_factor=capacity_factor)
        assert bool(routing.kept[3].any())
        # The reference: the one-hot path on finite inputs (itself checked against a per-token
        # loop in test_moe_dispatch.py).
        clean = experts_ffn(x, routing, weights, implementation="onehot")
        out = experts_ffn(x.at[3, 1].set(bad), routing, weights, implementation=implementation,
                          **FFN)
        others = np.arange(8) != 3
        np.testing.assert_allclose(out[others], clean[others], rtol=1e-5, atol=1e-6)
        assert np.isnan(np.asarray(out[3])).all()  # the token's own row is NaN, not hidden

    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    def test_dropped_assignments_are_exactly_zero_beside_a_nan_token(self, implementation):
        # Every token wants expert 0, whose capacity 2 keeps tokens 0 and 1 only; token 0 is
        # NaN and fills the first row that dropped assignments used to read.
        x, _, weights = _moe_case(tokens=6, experts=3)
        routing = route(jnp.zeros((6, 3)).at[:, 0].set(10.0), num_selected=1,
                        capacity_factor=1.0)
        np.testing.assert_array_equal(routing.kept[:, 0], [True, True] + [False] * 4)
        clean = experts_ffn(x, routing, weights, implementation="onehot")
        out = experts_ffn(x.at[0].set(jnp.nan), routing, weights, implementation=implementation,
                          **FFN)
        assert np.isnan(np.asarray(out[0])).all()
        np.testing.assert_allclose(out[1], clean[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[2:], 0.0)

    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    def test_a_non_finite_token_with_every_assignment_dropped_outputs_zero(self,
                                                                          implementation):
        x, logits, weights = _moe_case()
        routing = route(logits, num_selected=2)
        routing = dataclasses.replace(routing, kept=routing.kept.at[3].set(False))
        out = experts_ffn(x.at[3].set(jnp.inf), routing, weights, implementation=implementation,
                          **FFN)
        np.testing.assert_array_equal(out[3], 0.0)
        assert np.isfinite(np.asarray(out)).all()

    @pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
    def test_nan_weights_of_dropped_assignments_are_never_read(self, implementation):
        x, logits, weights = _moe_case()
        routing = route(logits, num_selected=2, capacity_factor=0.5)
        assert not bool(routing.kept.all())
        poisoned = dataclasses.replace(
            routing, weights=jnp.where(routing.kept, routing.weights, jnp.nan))
        np.testing.assert_array_equal(
            experts_ffn(x, poisoned, weights, implementation=implementation, **FFN),
            experts_ffn(x, routing, weights, implementation=implementation, **FFN))

    def test_a_nan_token_through_the_whole_layer(self):
        # Its router logits are NaN too, so it routes nowhere (output 0) and counts in neither
        # loss; dropless, the other tokens get exactly the outputs of a run without it.
        x, _, weights = _moe_case()
        router = jax.random.normal(jax.random.key(5), (4, 4))
        bad = x.at[3, 2].set(jnp.nan)
        out, routing = moe(bad, router, weights, num_selected=2)
        mask = jnp.arange(8) != 3
        clean, masked = moe(x, router, weights, num_selected=2, token_mask=mask)
        np.testing.assert_array_equal(routing.kept[3], False)
        np.testing.assert_array_equal(out[3], 0.0)
        np.testing.assert_allclose(out[mask], clean[mask], rtol=1e-6)
        np.testing.assert_allclose(routing.load_balancing_loss, masked.load_balancing_loss,
                                   rtol=1e-6)
        np.testing.assert_allclose(routing.router_z_loss, masked.router_z_loss, rtol=1e-6)


def _route(logits, policy, **kwargs):
    return route(jnp.asarray(logits, jnp.float32), num_selected=kwargs.pop("k", 2),
                 policy=policy, **kwargs)


def _assert_same_routing(ours, expected, rows=slice(None)):
    for field in ("expert_ids", "weights", "kept", "slot"):
        np.testing.assert_allclose(getattr(ours, field)[rows], getattr(expected, field)[rows],
                                   rtol=1e-6, err_msg=field)


class TestRouterLogits:
    @pytest.mark.parametrize("policy", POLICIES)
    def test_plus_inf_is_softmax_s_limit(self, policy):
        # The limit is already reached at a large finite logit (exp(-1e4) is 0 in float32):
        # the token shares its weight equally between its two +inf experts.
        logits = np.array([[0.0, np.inf, 1.0, np.inf], [0.3, -0.2, 0.1, 0.5]])
        ours = _route(logits, policy)
        expected = _route(np.where(np.isinf(logits), 1e4, logits), policy)
        _assert_same_routing(ours, expected)
        np.testing.assert_array_equal(np.sort(ours.expert_ids[0]), [1, 3])
        np.testing.assert_allclose(ours.weights[0], [0.5, 0.5])
        assert np.isfinite(np.asarray(ours.load_balancing_loss))
        assert ours.router_z_loss == np.inf  # logsumexp of +inf: the loss's true value

    def test_plus_inf_top1_weight_is_the_limit_probability(self):
        # Switch (k = 1, no renormalisation): the weight is p, 1/2 with two +inf experts.
        routing = _route([[np.inf, 0.0, np.inf]], "topk", k=1)
        np.testing.assert_array_equal(routing.expert_ids, [[0]])
        np.testing.assert_allclose(routing.weights, [[0.5]])

    @pytest.mark.parametrize("policy", POLICIES)
    @pytest.mark.parametrize("bad", [-np.inf, np.nan])
    def test_nan_and_minus_inf_are_never_chosen(self, policy, bad):
        logits = np.array([[2.0, 1.0, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
        ours = _route(logits_with(logits, bad), policy)
        # The same as removing the expert for that token: a logit it can never reach.
        expected = _route(logits_with(logits, -1e4), policy)
        _assert_same_routing(ours, expected)
        assert 0 not in np.asarray(ours.expert_ids[0])
        assert np.isfinite(np.asarray([ours.load_balancing_loss, ours.router_z_loss])).all()

    @pytest.mark.parametrize("policy", ["topk", "deepseek"])
    def test_fewer_choosable_experts_than_k_leave_the_rest_not_kept(self, policy):
        logits = np.array([[-np.inf, np.nan, 3.0, -np.inf], [0.3, 0.4, 0.2, 0.1]])
        routing = _route(logits, policy, capacity_factor=1.0)  # capacity 1
        # Token 0's second assignment goes to expert 0 (the first of its unchoosable ones,
        # queued before token 1's second choice, expert 0) but is not kept and takes no slot.
        np.testing.assert_array_equal(routing.expert_ids, [[2, 0], [1, 0]])
        np.testing.assert_array_equal(routing.kept, [[True, False], [True, True]])
        np.testing.assert_array_equal(routing.slot[1], [0, 0])
        np.testing.assert_allclose(routing.weights[0], [1.0, 0.0])

    @pytest.mark.parametrize("policy", POLICIES)
    def test_a_token_with_no_choosable_expert_routes_nowhere_like_a_masked_one(self, policy):
        logits = np.array([[np.nan, np.nan, np.nan], [-np.inf, np.nan, -np.inf],
                           [0.1, 0.7, -0.3], [1.0, 0.2, 0.4]])
        ours = _route(logits, policy, capacity_factor=1.0)
        mask = jnp.array([False, False, True, True])
        masked = _route(np.nan_to_num(logits, nan=0.0, neginf=0.0), policy,
                        capacity_factor=1.0, token_mask=mask)
        np.testing.assert_array_equal(ours.kept[:2], False)
        np.testing.assert_array_equal(ours.weights[:2], 0.0)
        _assert_same_routing(ours, masked, rows=slice(2, None))
        np.testing.assert_allclose(ours.load_balancing_loss, masked.load_balancing_loss,
                                   rtol=1e-6)
        np.testing.assert_allclose(ours.router_z_loss, masked.router_z_loss, rtol=1e-6)

    def test_a_large_selection_bias_cannot_choose_a_minus_inf_expert(self):
        routing = route(jnp.array([[-jnp.inf, 0.0, 1.0]]), num_selected=1, policy="deepseek",
                        selection_bias=jnp.array([100.0, 0.0, 0.0]))
        np.testing.assert_array_equal(routing.expert_ids, [[2]])

    @pytest.mark.parametrize("policy", POLICIES)
    def test_losses_have_finite_gradients_beside_nan_and_minus_inf(self, policy):
        logits = jax.random.normal(jax.random.key(0), (6, 4))
        logits = logits.at[0, 1].set(-jnp.inf).at[2].set(jnp.nan).at[4, 3].set(jnp.nan)

        def losses(logits):
            routing = route(logits, num_selected=2, policy=policy)
            return (routing.load_balancing_loss + routing.router_z_loss
                    + jnp.sum(routing.weights * jnp.arange(12.0).reshape(6, 2)))

        grad = jax.grad(losses)(logits)
        assert np.isfinite(np.asarray(grad)).all()
        np.testing.assert_array_equal(grad[2], 0.0)  # a NaN token learns nothing


def logits_with(logits, value):
    """`logits` with entry [0, 0] replaced by `value`."""
    out = np.array(logits, np.float64)
    out[0, 0] = value
    return out


def _attention_and_grads(implementation, query, key, value, bias, mask):
    """Output and gradients w.r.t. query, key, value and bias of sum(out · cos(out))."""
    def loss(q, k, v, b):
        out = dot_product_attention(q, k, v, bias=b, mask=mask, implementation=implementation,
                                    block_sizes=(2, 4))
        return jnp.sum(out * jnp.cos(out)), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(query, key, value, bias)
    return out, grads


class TestMinusInfBias:
    def setup_method(self):
        keys = jax.random.split(jax.random.key(3), 4)
        self.query = jax.random.normal(keys[0], (2, 6, 4, 8))
        self.key, self.value = (jax.random.normal(k, (2, 8, 2, 8)) for k in keys[1:3])
        self.bias = jax.random.normal(keys[3], (1, 4, 6, 8))
        self.hidden = np.zeros((2, 4, 6, 8), bool)
        self.hidden[:, :, 1] = True  # row 1: -inf bias on every key
        self.hidden[:, 2, 3, 1::2] = True  # row 3 of head 2: half the keys by the bias, ...
        self.mask = np.ones((2, 1, 6, 8), bool)
        self.mask[:, :, 3, 0::2] = False  # ... the other half by the mask
        self.hidden[1, :, 4, 5] = True  # and one key of an ordinary row

    @pytest.mark.parametrize("implementation", ["reference", "blocked"])
    def test_a_minus_inf_bias_hides_keys_as_the_mask_does(self, implementation):
        bias = jnp.where(self.hidden, -jnp.inf, self.bias)
        out, grads = _attention_and_grads(implementation, self.query, self.key, self.value,
                                          bias, jnp.asarray(self.mask))
        # The same keys hidden by the mask, with a finite bias.
        expected, expected_grads = _attention_and_grads(
            "reference", self.query, self.key, self.value, jnp.broadcast_to(self.bias, bias.shape),
            jnp.asarray(self.mask & ~self.hidden))
        np.testing.assert_array_equal(out[:, 1], 0.0)  # fully hidden rows are zeros
        np.testing.assert_array_equal(out[:, 3, 2], 0.0)
        chex.assert_trees_all_close(out, expected, atol=2e-6, rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(grads[3])[self.hidden], 0.0)  # never NaN
        chex.assert_trees_all_close(grads, expected_grads, atol=2e-5, rtol=2e-5)
