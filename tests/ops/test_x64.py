"""The main attention and MoE cases once more with jax_enable_x64 on, where a bare jnp.zeros is
float64 and a bare arange int64: every kernel must keep its documented dtypes (float32
statistics, outputs in the input dtype) and give the reference's values and gradients.

x64 is switched on by the `x64` fixture with `jax.enable_x64`, a context manager, so it never
leaks into other tests of the process (jit caches key on the flag);
`test_x64_is_off_outside_the_fixture` checks that.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import attention_values_and_grads, expert_weights

from tfx.ops import dot_product_attention, sparse
from tfx.ops.attention import cached_attention
from tfx.ops.masks import length_mask
from tfx.ops.moe import IMPLEMENTATIONS, POLICIES, experts_ffn, route


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _qkv(batch, q_len, kv_len, num_heads, num_kv_heads, dtype=jnp.float32, head_dim=8):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, q_len, num_heads, head_dim)] + [(batch, kv_len, num_kv_heads, head_dim)] * 2
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]


def _case(name):
    """(q_len, kv_len, num_heads, num_kv_heads, kwargs) of the attention cases."""
    rng = np.random.default_rng(0)
    mask = rng.random((2, 1, 11, 13)) < 0.7
    mask[0, 0, 2] = False  # a fully masked row
    bias = rng.normal(size=(1, 4, 11, 13)).astype(np.float32)
    bias[:, :, 5] = -np.inf  # a row hidden by the bias
    segments = jnp.asarray([[0] * 4 + [1] * 7, [2] * 11])
    return {
        "plain": (11, 13, 4, 4, {}),
        "causal_mask_bias_gqa": (11, 13, 4, 2, dict(is_causal=True, mask=jnp.asarray(mask),
                                                    bias=jnp.asarray(bias))),
        "segments_sparsity_mqa": (11, 11, 4, 1, dict(
            query_segment_ids=segments, sparsity=sparse.SlidingWindow(3) | sparse.GlobalTokens(1))),
        "cross_segments_padding": (11, 13, 4, 2, dict(
            query_segment_ids=segments, key_segment_ids=jnp.asarray([[0] * 6 + [1] * 7] * 2),
            mask=length_mask(jnp.asarray([13, 9]), 13))),
    }[name]


@pytest.mark.usefixtures("x64")
class TestAttention:
    @pytest.mark.parametrize("name", ["plain", "causal_mask_bias_gqa", "segments_sparsity_mqa",
                                      "cross_segments_padding"])
    def test_blocked_equals_reference_in_float32(self, name):
        q_len, kv_len, num_heads, num_kv_heads, kwargs = _case(name)
        query, key, value = _qkv(2, q_len, kv_len, num_heads, num_kv_heads)
        cotangent = jax.random.normal(jax.random.key(1), query.shape, jnp.float32)
        blocked = attention_values_and_grads("blocked", query, key, value, cotangent,
                                             block_sizes=(4, 4), **kwargs)
        reference = attention_values_and_grads("reference", query, key, value, cotangent,
                                               **kwargs)
        assert {x.dtype for x in jax.tree.leaves(blocked)} == {np.dtype(jnp.float32)}
        chex.assert_trees_all_close(blocked, reference, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize("dtype, tolerance", [(jnp.float64, 1e-6), (jnp.bfloat16, 2e-2)])
    def test_other_input_dtypes(self, dtype, tolerance):
        q_len, kv_len, num_heads, num_kv_heads, kwargs = _case("causal_mask_bias_gqa")
        query, key, value = _qkv(2, q_len, kv_len, num_heads, num_kv_heads, dtype)
        outs = [dot_product_attention(query, key, value, implementation=implementation,
                                      block_sizes=(4, 4), **kwargs)
                for implementation in ("blocked", "reference")]
        assert outs[0].dtype == outs[1].dtype == dtype
        np.testing.assert_allclose(*(np.asarray(out, np.float32) for out in outs),
                                   atol=tolerance, rtol=tolerance)

    def test_cached_attention_equals_the_reference(self):
        query, key, value = _qkv(2, 3, 9, 4, 2)
        mask = length_mask(jnp.asarray([9, 5]), 9)
        cached = cached_attention(query, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3),
                                  mask=mask)
        expected = dot_product_attention(query, key, value, mask=mask, implementation="reference")
        assert cached.dtype == jnp.float32
        chex.assert_trees_all_close(cached, expected, atol=1e-6, rtol=1e-6)

    def test_splash_in_interpret_mode(self):
        query, key, value = _qkv(1, 128, 128, 2, 1, head_dim=16)
        cotangent = jax.random.normal(jax.random.key(1), query.shape, jnp.float32)
        kwargs = dict(is_causal=True, query_segment_ids=jnp.asarray([[0] * 50 + [1] * 78]),
                      mask=length_mask(jnp.asarray([100]), 128))
        splash = attention_values_and_grads("splash", query, key, value, cotangent, **kwargs)
        reference = attention_values_and_grads("reference", query, key, value, cotangent,
                                               **kwargs)
        chex.assert_trees_all_close(splash, reference, atol=1e-5, rtol=1e-5)

    def test_pallas_gpu_says_it_cannot_run(self):
        query, key, value = _qkv(1, 128, 128, 2, 2, head_dim=16)
        with pytest.raises(ValueError, match=r"implementation='pallas_gpu' cannot run this call; "
                                             r"it needs jax_enable_x64 off"):
            dot_product_attention(query, key, value, is_causal=True, implementation="pallas_gpu")


@pytest.mark.usefixtures("x64")
class TestMoe:
    @pytest.mark.parametrize("policy", POLICIES)
    def test_routing_stays_float32(self, policy):
        logits = jax.random.normal(jax.random.key(0), (8, 4), jnp.float32)
        routing = route(logits, num_selected=2, policy=policy, capacity_factor=1.0,
                        priority="probability", rng=jax.random.key(1), jitter=0.1)
        dtypes = {name: getattr(routing, name).dtype for name in (
            "expert_ids", "weights", "slot", "load_balancing_loss", "router_z_loss")}
        assert dtypes == {"expert_ids": jnp.int32, "weights": jnp.float32, "slot": jnp.int32,
                          "load_balancing_loss": jnp.float32, "router_z_loss": jnp.float32}

    def test_every_dispatch_equals_onehot(self):
        keys = jax.random.split(jax.random.key(2), 3)
        x = jax.random.normal(keys[0], (10, 4), jnp.float32)
        routing = route(jax.random.normal(keys[1], (10, 3), jnp.float32), num_selected=2,
                        capacity_factor=1.0)
        weights = jax.tree.map(lambda w: w.astype(jnp.float32),
                               expert_weights(keys[2], 3, 4, 8))
        reference = experts_ffn(x, routing, weights, implementation="onehot")
        for implementation in IMPLEMENTATIONS:
            out = experts_ffn(x, routing, weights, implementation=implementation, block_size=8,
                              interpret=True)
            assert out.dtype == jnp.float32
            chex.assert_trees_all_close(out, reference, atol=1e-6, rtol=1e-5)


def test_x64_is_off_outside_the_fixture():
    assert not jax.config.jax_enable_x64
    assert jnp.zeros(1).dtype == jnp.float32
