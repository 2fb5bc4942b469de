"""tfx.ops.matmul.flat_dot_general against numpy's product and lax.dot_general (values and
gradients), and its delegation of every contraction that is not a projection; add_bias and
apply_scale against the plain sum and product and their gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compile_as_users_do
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.matmul import add_bias, apply_scale, flat_dot_general

PLAIN = [(add_bias, jnp.add), (apply_scale, jnp.multiply)]


def dims(x):
    """lax's dimension numbers of a projection of x (its last axis by rhs's first)."""
    return (((x.ndim - 1,), (0,)), ((), ()))


def loss(dot, x, w):
    return jnp.sum(jnp.sin(dot(x, w, dims(x))))


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=2, max_size=3), d_in=st.integers(1, 6),
       d_out=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_projection_equals_numpy_and_lax_gradients(lead, d_in, d_out, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    out = flat_dot_general(jnp.asarray(x), jnp.asarray(w), dims(x))
    chex.assert_shape(out, (*lead, d_out))
    reference = np.einsum("...i,io->...o", x.astype(np.float64), w.astype(np.float64))
    chex.assert_trees_all_close(out, reference, atol=1e-5, rtol=1e-5)
    grads = jax.grad(lambda x, w: loss(flat_dot_general, x, w), argnums=(0, 1))(x, w)
    expected = jax.grad(lambda x, w: loss(jax.lax.dot_general, x, w), argnums=(0, 1))(x, w)
    chex.assert_trees_all_close(grads, expected, atol=1e-5, rtol=1e-5)


def test_other_contractions_go_to_lax_unchanged():
    rng = np.random.default_rng(0)
    cases = [
        (rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), (((1,), (0,)), ((), ()))),
        (rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5)),
         (((2,), (1,)), ((0,), (0,)))),                      # batch axes
        (rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)),
         (((2,), (1,)), ((), ()))),                          # rhs contracts its last axis
        (rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 2, 5)),
         (((2,), (0,)), ((), ()))),                          # rhs with three axes
    ]
    for lhs, rhs, numbers in cases:
        lhs, rhs = jnp.float32(lhs), jnp.float32(rhs)
        chex.assert_trees_all_equal(flat_dot_general(lhs, rhs, numbers),
                                    jax.lax.dot_general(lhs, rhs, numbers))


def test_precision_and_result_type_pass_through():
    x = jnp.ones((2, 3, 4), jnp.bfloat16)
    w = jnp.ones((4, 5), jnp.bfloat16)
    out = flat_dot_general(x, w, dims(x), precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    chex.assert_type(out, jnp.float32)
    chex.assert_trees_all_equal(out, jnp.full((2, 3, 5), 4.0, jnp.float32))


def float64_gradients(plain, y, p):
    """Gradients of sum(sin(y ∘ p)) for y and for p (∘: + or ·), in float64, p's summed over
    every row: d sin(y + p) = cos(y + p) (dy + dp), d sin(y p) = cos(y p) (p dy + y dp)."""
    y, p, added = np.float64(y), np.float64(p), plain is jnp.add
    g = np.cos(y + p if added else y * p)
    dy, dp = (g, g) if added else (g * p, g * y)
    return dy, dp.reshape(-1, p.shape[0]).sum(0)


@settings(max_examples=25, deadline=None)
@given(ops=st.sampled_from(PLAIN), lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       d_out=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_values_and_gradients_equal_the_plain_sum_and_product(ops, lead, d_out, seed):
    op, plain = ops
    rng = np.random.default_rng(seed)
    y = jnp.float32(rng.standard_normal((*lead, d_out)))
    p = jnp.float32(rng.standard_normal(d_out))
    chex.assert_trees_all_equal(op(y, p), plain(y, p))
    grads = jax.grad(lambda y, p: jnp.sum(jnp.sin(op(y, p))), argnums=(0, 1))(y, p)
    chex.assert_trees_all_close(grads, float64_gradients(plain, y, p), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", [add_bias, apply_scale])
def test_parameter_gradient_keeps_bfloat16_and_sums_in_float32(op):
    y = jnp.full((512, 3), 1.0, jnp.bfloat16)
    b = jnp.ones(3, jnp.bfloat16) if op is apply_scale else jnp.zeros(3, jnp.bfloat16)
    grad = jax.grad(lambda b: jnp.sum(op(y, b) * 0.01))(b)
    chex.assert_type(grad, jnp.bfloat16)
    # 512 terms of bfloat16(0.01) = 0.010009765625 sum to 5.125 exactly in float32; summed in
    # bfloat16 they drift (4.0 in sequence; XLA's reduce of the plain y + b gives 5.03)
    chex.assert_trees_all_equal(grad, jnp.full(3, 5.125, jnp.bfloat16))


@pytest.mark.parametrize("op", [add_bias, apply_scale])
def test_parameter_gradient_keeps_float64_under_x64(op):
    with jax.enable_x64(True):
        y, b = jnp.ones((1000, 2), jnp.float64), jnp.zeros(2, jnp.float64)
        weight = jnp.full((1000, 2), 1 + 2.0**-30, jnp.float64)
        grad = jax.grad(lambda b: jnp.sum(op(y, b) * weight))(b)
        chex.assert_type(grad, jnp.float64)
        # exact in float64; a float32 sum loses the 2**-30 and gives 1000
        chex.assert_trees_all_equal(grad, jnp.full(2, 1000 * (1 + 2.0**-30), jnp.float64))


@pytest.mark.parametrize("op, name", [(add_bias, "bias"), (apply_scale, "scale")])
def test_rejects_a_parameter_of_another_shape_or_dtype(op, name):
    y = jnp.ones((2, 3), jnp.float32)
    with pytest.raises(ValueError, match=rf"{name} must be \[3\] of dtype float32"):
        op(y, jnp.ones(4, jnp.float32))
    with pytest.raises(ValueError, match=rf"{name} must be \[3\] of dtype float32"):
        op(y, jnp.ones(3, jnp.bfloat16))


@pytest.mark.parametrize("op, plain", PLAIN)
def test_parameter_gradient_is_a_product_not_a_reduce_window(op, plain):
    """Under the training step's CPU options, autodiff of y + b (or y · s) compiles the
    parameter's gradient into reduce-windows (the test can fail); add_bias's and apply_scale's
    compile into none."""
    y, b = jnp.ones((16, 255, 384)), jnp.ones(384)
    options = {"xla_cpu_experimental_ynn_fusion_type": ""}

    def compiled(add):
        grad = jax.jit(jax.grad(lambda y, b: jnp.sum(jax.nn.gelu(add(y, b))), argnums=(0, 1)))
        return compile_as_users_do(grad.lower(y, b), **options).as_text()

    if jax.default_backend() == "cpu":
        assert "reduce-window" in compiled(plain)
    assert "reduce-window" not in compiled(op)
