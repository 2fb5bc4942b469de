"""tfx.ops.dot_product_attention against jax.nn.dot_product_attention, a written-out formula and
PyTorch's scaled_dot_product_attention."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops import dot_product_attention, sparse
from tfx.ops.masks import length_mask


def _qkv(seed, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    query = jax.random.normal(kq, (batch, q_len, num_heads, head_dim), dtype)
    key = jax.random.normal(kk, (batch, kv_len, num_kv_heads, head_dim), dtype)
    value = jax.random.normal(kv, (batch, kv_len, num_kv_heads, head_dim), dtype)
    return query, key, value


def _naive(query, key, value, mask=None, bias=None, scale=None):
    """The definition, one head at a time, in float64 numpy, with K/V heads repeated explicitly."""
    q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
    batch, q_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    shape = (batch, num_heads, q_len, k.shape[1])
    mask = np.ones(shape, bool) if mask is None else np.broadcast_to(np.asarray(mask), shape)
    bias = np.zeros(shape) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), shape)
    out = np.zeros((batch, q_len, num_heads, v.shape[-1]))
    for b in range(batch):
        for h in range(num_heads):
            scores = q[b, :, h] @ k[b, :, h // group].T * scale + bias[b, h]
            scores = np.where(mask[b, h], scores, -np.inf)
            row_max = np.max(scores, axis=-1, keepdims=True)
            row_max = np.where(np.isinf(row_max), 0, row_max)
            weights = np.where(mask[b, h], np.exp(scores - row_max), 0)
            total = weights.sum(-1, keepdims=True)
            out[b, :, h] = (weights / np.where(total == 0, 1, total)) @ v[b, :, h // group]
    return out


HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


class TestWithAndWithoutJit(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        heads=HEADS, is_causal=[False, True], lengths=[(8, 8), (5, 11), (12, 7)]
    )
    def test_values_equal_jax(self, heads, is_causal, lengths):
        query, key, value = _qkv(0, 2, *lengths, *heads, 16)
        attend = self.variant(
            lambda q, k, v: dot_product_attention(q, k, v, is_causal=is_causal)
        )
        expected = jax.nn.dot_product_attention(query, key, value, is_causal=is_causal)
        chex.assert_trees_all_close(attend(query, key, value), expected, atol=1e-5, rtol=1e-5)


class TestAgainstJax:
    @pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
    def test_mask_and_bias(self, num_heads, num_kv_heads):
        query, key, value = _qkv(1, 2, 6, 9, num_heads, num_kv_heads, 8)
        rng = np.random.default_rng(0)
        mask = rng.random((2, 1, 6, 9)) < 0.7
        mask[..., 0] = True  # jax.nn averages fully masked rows; keep every row non-empty here
        bias = rng.normal(size=(1, num_heads, 6, 9)).astype(np.float32)
        ours = dot_product_attention(query, key, value, mask=jnp.asarray(mask), bias=bias)
        expected = jax.nn.dot_product_attention(query, key, value, mask=mask, bias=bias)
        chex.assert_trees_all_close(ours, expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
    @pytest.mark.parametrize("is_causal", [False, True])
    def test_gradients(self, num_heads, num_kv_heads, is_causal):
        query, key, value = _qkv(2, 2, 7, 7, num_heads, num_kv_heads, 8)
        bias = jax.random.normal(jax.random.key(3), (1, num_heads, 7, 7))

        def loss(fn):
            def f(q, k, v, b):
                out = fn(q, k, v, bias=b, is_causal=is_causal)
                return jnp.sum(out * jnp.cos(out))

            return jax.grad(f, argnums=(0, 1, 2, 3))(query, key, value, bias)

        chex.assert_trees_all_close(
            loss(dot_product_attention), loss(jax.nn.dot_product_attention), atol=1e-5, rtol=1e-5
        )

    @pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
    def test_bfloat16(self, num_heads, num_kv_heads):
        query, key, value = _qkv(4, 2, 16, 16, num_heads, num_kv_heads, 32, jnp.bfloat16)
        ours = dot_product_attention(query, key, value, is_causal=True)
        expected = jax.nn.dot_product_attention(query, key, value, is_causal=True)
        assert ours.dtype == jnp.bfloat16
        chex.assert_trees_all_close(
            ours.astype(jnp.float32), expected.astype(jnp.float32), atol=2e-2, rtol=2e-2
        )
        exact = _naive(query, key, value, mask=np.tril(np.ones((16, 16), bool)))
        np.testing.assert_allclose(np.asarray(ours, np.float32), exact, atol=3e-2, rtol=3e-2)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    q_len=st.integers(1, 9),
    kv_len=st.integers(1, 9),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([1, 4, 8]),
    value_dim=st.sampled_from([2, 8]),
    seed=st.integers(0, 2**16),
)
def test_matches_written_out_formula(batch, q_len, kv_len, num_kv_heads, group, head_dim,
                                     value_dim, seed):
    num_heads = num_kv_heads * group
    query, key, value = _qkv(seed, batch, q_len, kv_len, num_heads, num_kv_heads, head_dim)
    value = jax.random.normal(jax.random.key(seed + 1), (batch, kv_len, num_kv_heads, value_dim),
                              query.dtype)
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, num_heads, q_len, kv_len)) < 0.6  # some rows fully masked
    bias = rng.normal(size=(num_heads, q_len, kv_len)).astype(np.float32)
    ours = dot_product_attention(query, key, value, mask=jnp.asarray(mask), bias=bias, scale=0.7)
    chex.assert_shape(ours, (batch, q_len, num_heads, value_dim))
    expected = _naive(query, key, value, mask=mask, bias=bias, scale=0.7)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    query, key, value = _qkv(5, 2, 4, 6, 4, 2, 8)
    lengths = jnp.array([0, 3])  # the first sequence has no visible key at all
    mask = length_mask(lengths, 6)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, mask=mask) ** 2)

    out = dot_product_attention(query, key, value, mask=mask)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.all(np.abs(np.asarray(out[1])) > 0)
    grads = jax.grad(loss, argnums=(0, 1, 2))(query, key, value)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(grads[0][0]), 0.0)


def test_causal_rows_beyond_keys_see_everything():
    """T > S with is_causal: query i sees keys j <= i, so rows i >= S see all keys."""
    query, key, value = _qkv(6, 1, 6, 3, 2, 2, 4)
    ours = dot_product_attention(query, key, value, is_causal=True)
    full = dot_product_attention(query, key, value)
    chex.assert_trees_all_close(ours[:, 3:], full[:, 3:], atol=1e-6)


@pytest.mark.parametrize(
    "spec",
    [
        sparse.SlidingWindow(3),
        sparse.Strided(3),
        sparse.Fixed(4, 1),
        sparse.GlobalTokens(2) | sparse.SlidingWindow(2),
        sparse.RandomBlocks(4, 1, seed=3) & sparse.Causal(),
    ],
    ids=str,
)
def test_sparsity_equals_its_dense_mask(spec):
    query, key, value = _qkv(7, 2, 12, 12, 4, 2, 8)
    ours = dot_product_attention(query, key, value, sparsity=spec)
    expected = _naive(query, key, value, mask=spec.dense(12, 12))
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-5, rtol=1e-5)


def test_sparsity_and_causal_and_mask_combine():
    query, key, value = _qkv(8, 1, 10, 10, 2, 1, 4)
    user_mask = np.random.default_rng(1).random((1, 2, 10, 10)) < 0.8
    spec = sparse.SlidingWindow(4)
    ours = dot_product_attention(
        query, key, value, mask=jnp.asarray(user_mask), is_causal=True, sparsity=spec
    )
    combined = user_mask & np.tril(np.ones((10, 10), bool)) & spec.dense(10, 10)
    expected = _naive(query, key, value, mask=combined)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-5, rtol=1e-5)


def test_grouped_heads_never_repeat_key_value():
    """No intermediate of the compiled graph has key/value repeated to [B, S, num_heads, D]."""
    query, key, value = _qkv(9, 2, 5, 13, 8, 2, 16)
    jaxpr = jax.make_jaxpr(dot_product_attention)(query, key, value)
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns[0].params["jaxpr"].eqns
              for v in eqn.outvars}
    assert (2, 13, 8, 16) not in shapes
    assert not any(s[:2] == (2, 13) and 8 in s[2:3] for s in shapes)


def test_matches_torch_sdpa():
    torch = pytest.importorskip("torch")
    query, key, value = _qkv(10, 2, 9, 9, 6, 2, 8)
    mask = np.random.default_rng(2).random((2, 1, 9, 9)) < 0.8
    mask[..., 0] = True

    def to_torch(x):  # [B, T, H, D] -> [B, H, T, D]
        return torch.from_numpy(np.array(x)).transpose(1, 2)

    for kwargs, torch_kwargs in [({"is_causal": True}, {"is_causal": True}),
                                 ({"mask": jnp.asarray(mask)},
                                  {"attn_mask": torch.from_numpy(mask)})]:
        ours = dot_product_attention(query, key, value, **kwargs)
        expected = torch.nn.functional.scaled_dot_product_attention(
            to_torch(query), to_torch(key), to_torch(value), enable_gqa=True, **torch_kwargs
        ).transpose(1, 2)
        np.testing.assert_allclose(np.asarray(ours), expected.numpy(), atol=1e-5, rtol=1e-5)


class TestBadInput:
    def setup_method(self):
        self.q, self.k, self.v = _qkv(0, 2, 4, 5, 8, 2, 16)

    @pytest.mark.parametrize(
        "kwargs,error,match",
        [
            ({"implementation": "flash"}, ValueError, "implementation must be one of"),
            ({"mask": jnp.ones((2, 1, 4, 5), jnp.float32)}, TypeError, "mask must be a boolean"),
            ({"mask": jnp.ones((3, 1, 4, 5), bool)}, ValueError, "mask of shape"),
            ({"mask": jnp.ones((1, 1, 1, 4, 5), bool)}, ValueError, "at most 4 dims"),
            ({"bias": jnp.ones((1, 8, 5, 4))}, ValueError, "bias of shape"),
            ({"bias": jnp.ones((1, 1, 4, 5), jnp.int32)}, TypeError, "bias must have a floating"),
            ({"is_causal": 1}, TypeError, "is_causal must be a bool"),
            ({"scale": -1.0}, ValueError, "scale must be > 0"),
            ({"sparsity": "causal"}, TypeError, "sparsity must be a tfx.ops.sparse spec"),
        ],
    )
    def test_arguments(self, kwargs, error, match):
        with pytest.raises(error, match=match):
            dot_product_attention(self.q, self.k, self.v, **kwargs)

    def test_shapes(self):
        q, k, v = self.q, self.k, self.v
        cases = [
            ((q[0, 0], k, v), ValueError, r"query must have 4 dims \[batch, q_len"),
            ((q[0], k, v), ValueError, r"key must have 3 dims like query"),
            ((q, k[:1], v[:1]), ValueError, r"key batch \(1\) must equal query batch \(2\)"),
            ((q, k[..., :8], v), ValueError, r"key head_dim \(8\) must equal query head_dim"),
            ((q, k, v[:, :4]), ValueError, "value shape"),
            ((q[:, :, :6], k[:, :, :1].repeat(4, 2), v[:, :, :1].repeat(4, 2)), ValueError,
             r"num_kv_heads \(4\) must divide num_heads \(6\)"),
            ((q.astype(jnp.int32), k, v), TypeError, "query must have a floating dtype"),
            ((q, k.astype(jnp.bfloat16), v), TypeError, "must share a dtype"),
            ((np.asarray(q).tolist(), k, v), TypeError, "query must be a jax or numpy array"),
        ]
        for args, error, match in cases:
            with pytest.raises(error, match=match):
                dot_product_attention(*args)
