"""Tests for tfx.ops.positional.sinusoidal against the paper's formula, written out here."""

import functools

import chex
import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfx.ops.positional.absolute import sinusoidal


def vaswani_reference(positions, dim, base=10000.0):
    """PE[p, 2i] = sin(p / base^(2i/dim)), PE[p, 2i+1] = cos(p / base^(2i/dim)), in float64."""
    positions = np.asarray(positions, np.float64)
    out = np.zeros((*positions.shape, dim))
    for index in np.ndindex(positions.shape):
        for i in range(dim // 2):
            angle = positions[index] / base ** (2 * i / dim)
            out[(*index, 2 * i)] = np.sin(angle)
            out[(*index, 2 * i + 1)] = np.cos(angle)
    return out


def interleaved_to_concat(pe):
    return np.concatenate([pe[..., 0::2], pe[..., 1::2]], axis=-1)


class SinusoidalTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_interleaved_matches_paper_formula(self):
        positions = np.arange(24, dtype=np.int32).reshape(2, 3, 4) * 3
        fn = self.variant(functools.partial(sinusoidal, dim=10))
        out = fn(jnp.asarray(positions))
        chex.assert_shape(out, (2, 3, 4, 10))
        chex.assert_type(out, jnp.float32)
        chex.assert_trees_all_close(out, vaswani_reference(positions, 10), atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_concat_is_sin_half_then_cos_half(self):
        # Transformer-XL's layout: [sin(p w_0), sin(p w_1), ... | cos(p w_0), cos(p w_1), ...].
        positions = np.array([0.0, 0.5, 7.25, 31.0], np.float32)
        fn = self.variant(functools.partial(sinusoidal, dim=8, layout="concat", base=100.0))
        expected = interleaved_to_concat(vaswani_reference(positions, 8, base=100.0))
        chex.assert_trees_all_close(fn(jnp.asarray(positions)), expected, atol=1e-5)


def test_position_zero_is_sin_zero_cos_one():
    # sin(0) = 0 in the even slots and cos(0) = 1 in the odd slots, for any base.
    out = sinusoidal(jnp.zeros((), jnp.int32), 6)
    np.testing.assert_array_equal(out, [0, 1, 0, 1, 0, 1])


def test_custom_base_and_float_positions():
    positions = np.array([[1.5, 2.0], [3.25, 100.0]], np.float32)
    out = sinusoidal(jnp.asarray(positions), 4, base=500.0)
    chex.assert_trees_all_close(out, vaswani_reference(positions, 4, base=500.0), atol=1e-5)


def test_low_precision_positions_give_float32():
    out = sinusoidal(jnp.arange(8, dtype=jnp.bfloat16), 4)
    chex.assert_type(out, jnp.float32)
    chex.assert_trees_all_close(out, vaswani_reference(np.arange(8), 4), atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    positions=hnp.arrays(
        np.int32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
        elements=st.integers(0, 2048),
    ),
    half_dim=st.integers(1, 8),
    layout=st.sampled_from(["interleaved", "concat"]),
)
def test_shape_and_unit_circle(positions, half_dim, layout):
    # Each (sin, cos) pair lies on the unit circle, wherever the layout puts it.
    out = np.asarray(sinusoidal(jnp.asarray(positions), 2 * half_dim, layout=layout))
    assert out.shape == (*positions.shape, 2 * half_dim)
    if layout == "interleaved":
        sin, cos = out[..., 0::2], out[..., 1::2]
    else:
        sin, cos = out[..., :half_dim], out[..., half_dim:]
    np.testing.assert_allclose(sin**2 + cos**2, 1.0, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dim": 7}, ValueError, "dim must be even, got 7"),
        ({"dim": 0}, ValueError, "dim must be >= 2, got 0"),
        ({"dim": 4.0}, TypeError, "dim must be an int"),
        ({"dim": 4, "layout": "half"}, ValueError, "layout must be one of .*'half'"),
        ({"dim": 4, "base": 0.0}, ValueError, "base must be > 0, got 0.0"),
        ({"dim": 4, "base": "1e4"}, TypeError, "base must be a number"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        sinusoidal(jnp.arange(3), **kwargs)


def test_bool_positions_rejected():
    with pytest.raises(TypeError, match="positions must have an integer or floating dtype"):
        sinusoidal(jnp.ones(3, bool), 4)
