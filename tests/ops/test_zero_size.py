"""Zero-size inputs to the public ops: an empty batch or sequence gives the empty result of the
right shape and dtype, attention with no key gives zeros (the documented rule for rows that see
no key), and sizes with no meaning raise a ValueError naming the argument, never an XLA
"zero-size array to reduction" or a ZeroDivisionError from inside a kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import expert_weights

from tfx.ops import dot_product_attention, kv_cache, masks, sampling, sparse
from tfx.ops import positional as pos
from tfx.ops.attention import cached_attention
from tfx.ops.moe import IMPLEMENTATIONS, POLICIES, experts_ffn, moe, route

# (batch, q_len, kv_len): no example, no query, no key, neither.
EMPTY = [(0, 128, 128), (1, 0, 128), (1, 128, 0), (1, 0, 0)]


def _qkv(batch, q_len, kv_len, num_heads=4, num_kv_heads=2, head_dim=16, value_dim=16,
         dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (batch, q_len, num_heads, head_dim), dtype),
            jax.random.normal(keys[1], (batch, kv_len, num_kv_heads, head_dim), dtype),
            jax.random.normal(keys[2], (batch, kv_len, num_kv_heads, value_dim), dtype))


def _assert_zeros(x, shape, dtype=jnp.float32):
    assert x.shape == shape and x.dtype == dtype
    np.testing.assert_array_equal(np.asarray(x), 0.0)


@pytest.mark.parametrize("batch, q_len, kv_len", EMPTY)
@pytest.mark.parametrize("implementation", ["reference", "blocked", "splash", None])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"sparsity": sparse.Strided(4)}],
                         ids=["plain", "causal", "sparse"])
def test_attention_with_nothing_to_attend_is_zeros(batch, q_len, kv_len, implementation,
                                                   kwargs):
    query, key, value = _qkv(batch, q_len, kv_len)
    out = dot_product_attention(query, key, value, implementation=implementation, **kwargs)
    _assert_zeros(out, (batch, q_len, 4, 16))


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_no_key_with_mask_bias_and_segments_is_zeros_with_zero_gradients(implementation):
    query, key, value = _qkv(2, 5, 0, value_dim=8)
    kwargs = dict(mask=jnp.ones((2, 1, 5, 0), bool), bias=jnp.zeros((1, 4, 5, 0)),
                  query_segment_ids=jnp.zeros((2, 5), jnp.int32),
                  key_segment_ids=jnp.zeros((2, 0), jnp.int32), implementation=implementation)
    out = dot_product_attention(query, key, value, **kwargs)
    _assert_zeros(out, (2, 5, 4, 8))
    grads = jax.grad(lambda q, k, v: dot_product_attention(q, k, v, **kwargs).sum(),
                     argnums=(0, 1, 2))(query, key, value)
    for grad, x in zip(grads, (query, key, value), strict=True):
        _assert_zeros(grad, x.shape)


def test_pallas_gpu_self_attention_of_an_empty_batch():
    query, key, value = _qkv(0, 128, 128)
    out = dot_product_attention(query, key, value, is_causal=True, implementation="pallas_gpu")
    _assert_zeros(out, (0, 128, 4, 16))


@pytest.mark.parametrize("shapes", [((1, 4, 0, 8), (1, 4, 1, 8), (1, 4, 1, 8)),  # no head
                                    ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 0))],  # value_dim
                         ids=["num_heads", "value_dim"])
def test_attention_with_an_empty_output_dim(shapes):
    out = dot_product_attention(*(jnp.ones(s) for s in shapes))
    _assert_zeros(out, (*shapes[0][:3], shapes[2][3]))


@pytest.mark.parametrize("shapes, match", [
    (((1, 4, 2, 8), (1, 4, 0, 8), (1, 4, 0, 8)), r"num_kv_heads \(key and value dim 2\) must be "
                                                 r">= 1, got 0"),
    (((1, 4, 2, 0), (1, 4, 2, 0), (1, 4, 2, 0)), r"head_dim \(query and key dim 3\) must be "
                                                 r">= 1, got 0"),
])
def test_attention_without_kv_heads_or_head_dim_raises(shapes, match):
    with pytest.raises(ValueError, match=match):
        dot_product_attention(*(jnp.ones(s) for s in shapes))


@pytest.mark.parametrize("batch, kv_len", [(0, 6), (2, 0)])
def test_cached_attention(batch, kv_len):
    query = jnp.ones((batch, 1, 4, 8))
    key = jnp.ones((batch, 2, kv_len, 8))
    _assert_zeros(cached_attention(query, key, key), (batch, 1, 4, 8))


def test_cached_attention_without_kv_heads_raises():
    with pytest.raises(ValueError, match=r"num_kv_heads \(key and value dim 2\) must be >= 1"):
        cached_attention(jnp.ones((1, 1, 4, 8)), jnp.ones((1, 0, 3, 8)), jnp.ones((1, 0, 3, 8)))


EMPTY_POSITIONS = jnp.zeros((0,), jnp.int32)


@pytest.mark.parametrize("make, shape", [
    (lambda: masks.causal_mask(EMPTY_POSITIONS, jnp.arange(3)), (1, 1, 0, 3)),
    (lambda: masks.padding_mask(jnp.zeros((0, 3), bool)), (0, 1, 1, 3)),
    (lambda: masks.length_mask(EMPTY_POSITIONS, 4), (0, 1, 1, 4)),
    (lambda: masks.segment_mask(jnp.zeros((0, 3), jnp.int32)), (0, 1, 3, 3)),
    (lambda: masks.combine_masks(jnp.zeros((0, 1, 3, 3), bool), jnp.ones((1, 2, 3, 3), bool)),
     (0, 2, 3, 3)),
], ids=["causal", "padding", "length", "segment", "combine"])
def test_masks_of_nothing_are_empty(make, shape):
    out = make()
    assert out.shape == shape and out.dtype == jnp.bool_


SCALINGS = [None, pos.DynamicNTKScaling(2.0, 16), pos.YaRNScaling(2.0, 16)]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["none", "dynamic", "yarn"])
@pytest.mark.parametrize("x_shape, positions", [((1, 0, 2, 8), EMPTY_POSITIONS),
                                                ((0, 3, 2, 8), jnp.zeros((0, 3), jnp.int32))],
                         ids=["seq0", "batch0"])
def test_rope_of_no_token_is_empty(scaling, x_shape, positions):
    out = pos.apply_rope(jnp.ones(x_shape, jnp.bfloat16), positions, scaling=scaling)
    assert out.shape == x_shape and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("make, shape", [
    (lambda: pos.sinusoidal(EMPTY_POSITIONS, 8), (0, 8)),
    (lambda: pos.alibi_bias(pos.alibi_slopes(2), EMPTY_POSITIONS, jnp.arange(3)), (2, 0, 3)),
    (lambda: pos.t5_relative_bias(jnp.ones((32, 2)), EMPTY_POSITIONS, EMPTY_POSITIONS),
     (2, 0, 0)),
    (lambda: pos.transformer_xl_scores(*(jnp.ones(s) for s in [
        (1, 0, 2, 4), (1, 3, 2, 4), (3, 2, 4), (2, 4), (2, 4)])), (1, 2, 0, 3)),
], ids=["sinusoidal", "alibi", "t5", "transformer_xl"])
def test_positional_encodings_of_no_position_are_empty(make, shape):
    assert make().shape == shape


@pytest.mark.parametrize("window", [None, 4])
def test_a_cache_step_of_no_token_changes_nothing(window):
    cache = kv_cache.init_cache(num_layers=1, batch=2, max_len=8, num_kv_heads=1, head_dim=2,
                                window=window)
    step, planned = cache.plan(jnp.zeros((2, 0), bool))
    np.testing.assert_array_equal(planned.next_position, cache.next_position)
    np.testing.assert_array_equal(planned.positions, cache.positions)
    empty = jnp.zeros((2, 0, 1, 2))
    keys, _, layer = kv_cache.write(cache.layers[0], empty, empty, step)
    assert step.mask.shape[2] == 0 and keys.shape[:2] == (2, 1)
    np.testing.assert_array_equal(layer.key, cache.layers[0].key)


def test_sampling_an_empty_batch():
    logits = jnp.zeros((0, 5))
    assert sampling.filter_logits(logits, top_k=jnp.int32(2), top_p=0.5).shape == (0, 5)
    tokens = sampling.sample_logits(logits, jax.random.key(0), temperature=1.0, top_p=0.5)
    assert tokens.shape == (0,) and tokens.dtype == jnp.int32


@pytest.mark.parametrize("call", [
    lambda logits: sampling.filter_logits(logits, top_k=jnp.int32(2)),
    lambda logits: sampling.sample_logits(logits, None, temperature=0.0),
], ids=["filter", "greedy"])
def test_sampling_from_no_token_raises(call):
    with pytest.raises(ValueError, match=r"logits must have vocab >= 1 tokens, got shape"):
        call(jnp.zeros((2, 0)))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_routing_no_token(policy, capacity_factor):
    routing = route(jnp.zeros((0, 4)), num_selected=2, policy=policy,
                    capacity_factor=capacity_factor, priority="probability")
    assert routing.expert_ids.shape == routing.weights.shape == routing.kept.shape == (0, 2)
    np.testing.assert_array_equal([routing.load_balancing_loss, routing.router_z_loss], 0.0)


def test_routing_to_no_expert_raises():
    with pytest.raises(ValueError, match=r"router_logits must have num_experts >= 1, got shape "
                                         r"\(3, 0\)"):
        route(jnp.zeros((3, 0)), num_selected=1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("tokens, d_ff", [(0, 8), (5, 0)], ids=["no_token", "no_hidden_unit"])
def test_experts_of_nothing_are_zeros(implementation, tokens, d_ff):
    weights = expert_weights(jax.random.key(1), 3, 4, d_ff)
    routing = route(jax.random.normal(jax.random.key(2), (tokens, 3)), num_selected=2)
    out = experts_ffn(jnp.ones((tokens, 4)), routing, weights, implementation=implementation,
                      interpret=True)
    _assert_zeros(out, (tokens, 4))


def test_moe_layer_of_no_token():
    out, routing = moe(jnp.zeros((0, 4)), jnp.zeros((4, 3)),
                       expert_weights(jax.random.key(1), 3, 4, 8), num_selected=2)
    _assert_zeros(out, (0, 4))
    assert routing.kept.shape == (0, 2)
