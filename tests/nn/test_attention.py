"""tfx.nn.Attention against the same computation written with the op and the raw weights."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.nn import Attention
from tfx.ops import dot_product_attention, sparse


def _written_out(module, x, context, **kwargs):
    """x·Wq, context·Wk, context·Wv, the op, then ·Wo, from the module's parameters."""

    def proj(linear, inputs, heads):
        out = inputs @ linear.kernel[...]
        if linear.bias is not None:
            out = out + linear.bias[...]
        return out.reshape(*inputs.shape[:2], heads, -1)

    query = proj(module.query, x, module.num_heads)
    key = proj(module.key, context, module.num_kv_heads)
    value = proj(module.value, context, module.num_kv_heads)
    out = dot_product_attention(query, key, value, implementation="reference", **kwargs)
    return proj(module.out, out.reshape(*x.shape[:2], -1), 1)[..., 0, :]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_self_attention_matches_written_out(num_kv_heads):
    module = Attention(32, 4, num_kv_heads=num_kv_heads, use_bias=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))
    chex.assert_trees_all_close(module(x, is_causal=True),
                                _written_out(module, x, x, is_causal=True), atol=1e-5)


def test_cross_attention_with_other_width():
    module = Attention(16, 2, kv_features=24, head_dim=12, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    context = jax.random.normal(jax.random.key(2), (2, 7, 24))
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 5, 7)) < 0.8)
    out = module(x, context, mask=mask)
    chex.assert_shape(out, (2, 5, 16))
    chex.assert_trees_all_close(out, _written_out(module, x, context, mask=mask), atol=1e-5)


def test_blocked_implementation_by_config_gives_the_same_model():
    """The same weights under implementation="blocked" and "reference", values and gradients."""
    reference = Attention(32, 4, num_kv_heads=2, implementation="reference", rngs=nnx.Rngs(0))
    blocked = Attention(32, 4, num_kv_heads=2, implementation="blocked", block_sizes=(8, 8),
                        rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 30, 32))

    def loss(module):
        return jnp.sum(module(x, sparsity=sparse.SlidingWindow(10)) ** 2)

    chex.assert_trees_all_close(nnx.grad(loss)(blocked), nnx.grad(loss)(reference), atol=1e-4)
    chex.assert_trees_all_close(blocked(x, is_causal=True), reference(x, is_causal=True),
                                atol=1e-5)


def test_functional_use_through_split_and_merge():
    module = Attention(16, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(module)

    @jax.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x, is_causal=True)

    x = jax.random.normal(jax.random.key(1), (1, 6, 16))
    chex.assert_trees_all_close(apply(state, x), module(x, is_causal=True), atol=1e-6)


def test_bfloat16_compute_float32_params():
    module = Attention(16, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    out = module(jnp.ones((1, 4, 16)))
    assert out.dtype == jnp.bfloat16
    assert module.query.kernel[...].dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_kv_heads": 3}, r"num_kv_heads \(3\) must be >= 1 and divide num_heads \(4\)"),
        ({"implementation": "flash"}, "implementation must be one of"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(32, 4, rngs=nnx.Rngs(0), **kwargs)


def test_bad_width_and_input():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\)"):
        Attention(30, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have 3 dims \[batch, q_len, d_model\]"):
        Attention(32, 4, rngs=nnx.Rngs(0))(jnp.ones((4, 32)))


def _projections(module, x):
    def proj(linear, heads):
        return (x @ linear.kernel[...]).reshape(*x.shape[:2], heads, -1)

    return (proj(module.query, module.num_heads), proj(module.key, module.num_kv_heads),
            proj(module.value, module.num_kv_heads))


def test_rope_and_alibi_use_true_positions():
    """Positions shifted by a constant leave RoPE attention unchanged (relative property) and
    match the op applied by hand; ALiBi equals the op with the written-out bias."""
    from tfx.nn import ALiBi, Rotary
    from tfx.ops.positional import alibi_bias, alibi_slopes, apply_rope

    x = jax.random.normal(jax.random.key(3), (1, 6, 16))
    rope = Attention(16, 2, position=Rotary(theta=500.0), rngs=nnx.Rngs(0))
    positions = jnp.arange(6) + 40
    query, key, value = _projections(rope, x)
    expected = dot_product_attention(apply_rope(query, positions, theta=500.0),
                                     apply_rope(key, positions, theta=500.0), value,
                                     is_causal=True)
    expected = expected.reshape(1, 6, 16) @ rope.out.kernel[...]
    chex.assert_trees_all_close(rope(x, is_causal=True, positions=positions), expected, atol=1e-5)
    chex.assert_trees_all_close(rope(x, is_causal=True), expected, atol=1e-4)

    alibi = Attention(16, 2, position=ALiBi(2), rngs=nnx.Rngs(0))
    query, key, value = _projections(alibi, x)
    bias = alibi_bias(alibi_slopes(2), jnp.arange(6), jnp.arange(6))[None]
    expected = dot_product_attention(query, key, value, bias=bias, is_causal=True)
    chex.assert_trees_all_close(alibi(x, is_causal=True),
                                expected.reshape(1, 6, 16) @ alibi.out.kernel[...], atol=1e-5)


def test_transformer_xl_relative_attention_matches_the_paper_formula():
    """Dai et al. 2019, eq. (3): A_ij = (q_i + u)·k_j + (q_i + v)·W_R R_{i-j}, scaled, causal,
    with R built explicitly for every (i, j) here."""
    from tfx.nn import TransformerXL
    from tfx.ops.positional import sinusoidal

    xl = TransformerXL(16, 2, 8, scale=8**-0.5, dtype=None, param_dtype=jnp.float32,
                       rngs=nnx.Rngs(1))
    module = Attention(16, 2, position=xl, rngs=nnx.Rngs(0))
    xl.content_bias[...] = jax.random.normal(jax.random.key(4), (2, 8))
    xl.position_bias[...] = jax.random.normal(jax.random.key(5), (2, 8))
    x = jax.random.normal(jax.random.key(6), (2, 7, 16))
    query, key, value = (np.asarray(t, np.float64) for t in _projections(module, x))
    u, v = np.asarray(xl.content_bias[...]), np.asarray(xl.position_bias[...])
    w_r = np.asarray(xl.position_proj.kernel[...])
    out = np.zeros_like(value)
    for b in range(2):
        for h in range(2):
            scores = np.full((7, 7), -np.inf)
            for i in range(7):
                for j in range(i + 1):
                    r = np.asarray(sinusoidal(jnp.array(i - j), 16, layout="concat")) @ w_r
                    r = r.reshape(2, 8)[h]
                    scores[i, j] = ((query[b, i, h] + u[h]) @ key[b, j, h]
                                    + (query[b, i, h] + v[h]) @ r) / np.sqrt(8)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(-1, keepdims=True)) @ value[b, :, h]
    expected = out.reshape(2, 7, 16) @ np.asarray(module.out.kernel[...])
    np.testing.assert_allclose(module(x, is_causal=True), expected, atol=1e-4, rtol=1e-4)
