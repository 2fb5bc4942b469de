"""tfx.ops.masks against masks written out with Python loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops import masks


def test_causal_mask_from_positions():
    mask = masks.causal_mask(jnp.arange(4), jnp.arange(6))
    expected = np.array([[j <= i for j in range(6)] for i in range(4)])
    np.testing.assert_array_equal(mask, expected[None, None])


def test_causal_mask_for_cached_decoding_per_sequence():
    """One new token per sequence at different true positions, keys in a cache of length 5."""
    query_positions = jnp.array([[2], [4]])
    mask = masks.causal_mask(query_positions, jnp.arange(5))
    assert mask.shape == (2, 1, 1, 5)
    np.testing.assert_array_equal(mask[:, 0, 0], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize("side", ["right", "left"])
def test_length_mask(side):
    lengths = np.array([0, 2, 5])
    mask = masks.length_mask(jnp.asarray(lengths), 5, padding_side=side)
    for b, n in enumerate(lengths):
        real = [j < n for j in range(5)] if side == "right" else [j >= 5 - n for j in range(5)]
        np.testing.assert_array_equal(mask[b, 0, 0], real)


def test_padding_mask_is_the_valid_flags():
    valid = np.array([[True, True, False], [True, False, False]])
    np.testing.assert_array_equal(masks.padding_mask(jnp.asarray(valid)), valid[:, None, None])


def test_segment_mask_for_packed_sequences():
    segments = np.array([[1, 1, 2, 2, 2, 0]])
    mask = masks.segment_mask(jnp.asarray(segments))
    expected = [[segments[0, i] == segments[0, j] for j in range(6)] for i in range(6)]
    np.testing.assert_array_equal(mask[0, 0], expected)
    packed_causal = masks.combine_masks(mask, masks.causal_mask(jnp.arange(6), jnp.arange(6)))
    np.testing.assert_array_equal(packed_causal[0, 0], np.tril(expected))


def test_combine_masks():
    a = jnp.asarray(np.random.default_rng(0).random((2, 1, 3, 4)) < 0.5)
    b = jnp.asarray(np.random.default_rng(1).random((1, 1, 1, 4)) < 0.5)
    np.testing.assert_array_equal(masks.combine_masks(a, None, b), np.logical_and(a, b))
    assert masks.combine_masks(None, None) is None


def test_bad_input():
    with pytest.raises(TypeError, match="query_positions must have an integer dtype"):
        masks.causal_mask(jnp.arange(3.0), jnp.arange(3))
    with pytest.raises(ValueError, match=r"key_positions must have shape \[len\]"):
        masks.causal_mask(jnp.arange(3), jnp.zeros((1, 2, 3), jnp.int32))
    with pytest.raises(ValueError, match="key_positions of shape"):
        masks.causal_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(ValueError, match="padding_side must be 'right' or 'left'"):
        masks.length_mask(jnp.array([1]), 4, padding_side="middle")
    with pytest.raises(ValueError, match="kv_len must be >= 1"):
        masks.length_mask(jnp.array([1]), 0)
    with pytest.raises(TypeError, match="valid must be a boolean"):
        masks.padding_mask(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"key_segment_ids batch \(1\)"):
        masks.segment_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(TypeError, match=r"masks\[1\] must be a boolean"):
        masks.combine_masks(jnp.ones((1, 1, 2, 2), bool), jnp.ones((1, 1, 2, 2)))
    with pytest.raises(ValueError, match="do not broadcast together"):
        masks.combine_masks(jnp.ones((2, 1, 2, 2), bool), jnp.ones((3, 1, 2, 2), bool))
