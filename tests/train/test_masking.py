"""Tests for tfx.train.masking.mask_tokens (BERT §3.1: choose 15%, then 80% [MASK], 10% random,
10% unchanged). Statistical checks use fixed seeds and allow 5 binomial standard deviations."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.train.masking import mask_tokens

PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = 300
SPECIALS = (PAD, CLS, SEP, MASK)


def rows_with_padding(batch=64, seq_len=512, seed=0):
    """[CLS] ordinary tokens [SEP] [PAD]..., lengths varying per row; int32 [batch, seq_len]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, VOCAB, (batch, seq_len))
    lengths = rng.integers(seq_len // 2, seq_len - 1, (batch, 1))
    col = np.arange(seq_len)
    ids = np.where(col == 0, CLS, np.where(col <= lengths, ids, np.where(
        col == lengths + 1, SEP, PAD)))
    return jnp.asarray(ids, jnp.int32)


def corrupt(ids, probability=0.15, seed=0):
    return mask_tokens(jax.random.key(seed), ids, mask_token_id=MASK, vocab_size=VOCAB,
                       special_ids=SPECIALS, probability=probability)


def assert_binomial(count, trials, p):
    std = np.sqrt(trials * p * (1 - p))
    assert abs(count - trials * p) < 5 * std, (count, trials * p, std)


@pytest.mark.parametrize("probability", [0.15, 0.3])
def test_selection_rate_and_80_10_10_split(probability):
    ids = rows_with_padding()
    masked, chosen = corrupt(ids, probability)
    ids, masked, chosen = np.asarray(ids), np.asarray(masked), np.asarray(chosen)
    eligible = ids >= 4
    assert_binomial(chosen.sum(), eligible.sum(), probability)
    num_chosen = chosen.sum()
    to_mask = chosen & (masked == MASK)
    unchanged = chosen & (masked == ids)
    replaced = chosen & ~to_mask & ~unchanged
    # A random replacement equals the original with chance 1 / (number of ordinary ids).
    same_by_chance = 0.1 / (VOCAB - len(SPECIALS))
    assert_binomial(to_mask.sum(), num_chosen, 0.8)
    assert_binomial(replaced.sum(), num_chosen, 0.1 - same_by_chance)
    assert_binomial(unchanged.sum(), num_chosen, 0.1 + same_by_chance)


def test_tokens_not_chosen_are_untouched_and_specials_never_chosen():
    ids = rows_with_padding()
    masked, chosen = corrupt(ids, probability=0.9)
    ids, masked, chosen = np.asarray(ids), np.asarray(masked), np.asarray(chosen)
    special = np.isin(ids, SPECIALS)
    assert not chosen[special].any()
    np.testing.assert_array_equal(masked[~chosen], ids[~chosen])
    assert chosen[~special].mean() > 0.85


def test_random_replacements_are_ordinary_ids_spread_over_the_vocabulary():
    ids = jnp.full((64, 512), 10, jnp.int32)  # every replacement that differs is visible
    masked, chosen = corrupt(ids, probability=0.9)
    masked = np.asarray(masked)
    replaced = masked[np.asarray(chosen) & (masked != MASK) & (masked != 10)]
    assert replaced.min() >= 4 and replaced.max() < VOCAB  # never PAD/CLS/SEP/MASK
    assert len(np.unique(replaced)) > 0.95 * (VOCAB - 5)  # all other ordinary ids appear
    # Uniform over the 296 ordinary ids: each count is Binomial(n, 1/296).
    counts = np.bincount(replaced, minlength=VOCAB)[4:]
    counts = counts[np.arange(4, VOCAB) != 10]
    assert_binomial(counts.max(), len(replaced), 1 / (VOCAB - 4))


def test_mask_token_counts_as_special_even_when_not_listed():
    ids = jnp.full((8, 64), MASK, jnp.int32)
    masked, chosen = mask_tokens(jax.random.key(0), ids, mask_token_id=MASK, vocab_size=VOCAB,
                                 special_ids=(PAD,), probability=0.5)
    assert not np.asarray(chosen).any()
    np.testing.assert_array_equal(masked, ids)


def test_shapes_dtypes_and_keys():
    ids = rows_with_padding(4, 32).astype(jnp.int16)
    masked, chosen = corrupt(ids)
    chex.assert_shape([masked, chosen], (4, 32))
    chex.assert_type([masked, chosen], [jnp.int16, jnp.bool_])
    other, _ = corrupt(ids, seed=1)
    assert not np.array_equal(masked, other)
    again, _ = mask_tokens(jax.random.PRNGKey(0), ids, mask_token_id=MASK, vocab_size=VOCAB,
                           special_ids=SPECIALS)  # raw uint32 keys work too
    chex.assert_shape(again, (4, 32))


class MaskTokensVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        fn = self.variant(functools.partial(mask_tokens, mask_token_id=MASK, vocab_size=VOCAB,
                                            special_ids=SPECIALS, probability=0.2))
        ids = rows_with_padding(8, 128)
        masked, chosen = fn(jax.random.key(3), ids)
        expected_masked, expected_chosen = corrupt(ids, probability=0.2, seed=3)
        chex.assert_trees_all_equal((masked, chosen), (expected_masked, expected_chosen))
        assert np.asarray(chosen).any()


def test_jit_with_static_keywords():
    fn = jax.jit(mask_tokens, static_argnames=("mask_token_id", "vocab_size", "special_ids",
                                               "probability"))
    ids = rows_with_padding(4, 64)
    chex.assert_trees_all_equal(
        fn(jax.random.key(0), ids, mask_token_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS),
        corrupt(ids))


@pytest.mark.parametrize("probability", [0.0, 1.0, -0.1, 1.5])
def test_probability_outside_open_interval(probability):
    with pytest.raises(ValueError, match="probability"):
        corrupt(rows_with_padding(2, 8), probability)


def test_bad_ids_arguments():
    ids = rows_with_padding(2, 8)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="mask_token_id"):
        mask_tokens(key, ids, mask_token_id=VOCAB, vocab_size=VOCAB, special_ids=SPECIALS)
    with pytest.raises(ValueError, match="special_ids"):
        mask_tokens(key, ids, mask_token_id=MASK, vocab_size=VOCAB, special_ids=(PAD, -1))
    with pytest.raises(ValueError, match="special_ids"):
        mask_tokens(key, ids, mask_token_id=1, vocab_size=2, special_ids=(0,))
    with pytest.raises(TypeError, match="input_ids"):
        mask_tokens(key, ids.astype(jnp.float32), mask_token_id=MASK, vocab_size=VOCAB,
                    special_ids=SPECIALS)
