"""The state of a linear-attention layer in a cache: the short convolution with padding
anywhere against a written-out loop over the real inputs; the token loop's per-token states
against the recurrence; `record` / `rewind_state` (the ring of states before the last tokens)
against states computed by feeding the shorter sequences."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops.linear_attention import (
    DeltaState,
    causal_conv1d,
    empty_state,
    gated_delta_recurrent,
    record,
    rewind_state,
)


def _conv_over_real_inputs(x, weight, state, mask):
    """Per row, u = the state's inputs then the real tokens' inputs; a real token's output is
    Σ_i weight[i] · u[-taps + i] just after it joins u, padding's is 0. Returns the outputs,
    the next state (u's last taps - 1) and the state before each token."""
    taps = weight.shape[0]
    ys, finals, befores = [], [], []
    for row in range(x.shape[0]):
        u = list(state[row])
        y, before = [], []
        for t in range(x.shape[1]):
            before.append(np.stack(u[len(u) - (taps - 1):]))
            if mask[row, t]:
                u.append(x[row, t])
                y.append(sum(weight[i] * u[len(u) - taps + i] for i in range(taps)))
            else:
                y.append(np.zeros_like(x[row, t]))
        ys.append(np.stack(y))
        finals.append(np.stack(u[len(u) - (taps - 1):]))
        befores.append(np.stack(before))
    return np.stack(ys), np.stack(finals), np.stack(befores)


@pytest.mark.parametrize("pattern", ["left", "right", "middle", "none real", "all real"])
def test_masked_conv_equals_the_loop_over_real_inputs(pattern):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)
    weight = rng.normal(size=(4, 5)).astype(np.float32)
    state = rng.normal(size=(3, 3, 5)).astype(np.float32)
    mask = {"left": np.arange(7) >= np.array([[2], [5], [0]]),
            "right": np.arange(7) < np.array([[2], [6], [1]]),
            "middle": rng.random((3, 7)) < 0.5,
            "none real": np.zeros((3, 7), bool),
            "all real": np.ones((3, 7), bool)}[pattern]
    y, final, before = causal_conv1d(x, weight, state=state, token_mask=mask, history=5)
    want_y, want_final, want_before = _conv_over_real_inputs(x, weight, state, mask)
    chex.assert_trees_all_close((y, final, before), (want_y, want_final, want_before[:, -5:]),
                                atol=1e-5)
    if pattern == "all real":  # the mask changes nothing when every token is real
        chex.assert_trees_all_close(causal_conv1d(x, weight, state=state), (y, final),
                                    atol=1e-6)


def test_masked_conv_in_pieces_equals_one_call():
    """A right-padded chunk, then a left-padded one: the state carries only real inputs."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 10, 3)).astype(np.float32)
    weight = rng.normal(size=(3, 3)).astype(np.float32)
    mask = rng.random((2, 10)) < 0.7
    y, final = causal_conv1d(x, weight, token_mask=mask)
    first, mid = causal_conv1d(x[:, :4], weight, token_mask=mask[:, :4])
    rest, end = causal_conv1d(x[:, 4:], weight, state=mid, token_mask=mask[:, 4:])
    chex.assert_trees_all_close((jnp.concatenate([first, rest], 1), end), (y, final), atol=1e-6)
    with pytest.raises(ValueError, match=r"token_mask must be \[batch, seq\]"):
        causal_conv1d(x, weight, token_mask=mask[:, :3])


def _rule_inputs(seed, batch=2, seq=6, key_heads=1, heads=2, key_dim=4, value_dim=3):
    keys = jax.random.split(jax.random.key(seed), 5)
    unit = lambda t: t / jnp.linalg.norm(t, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(keys[0], (batch, seq, key_heads, key_dim)))
    k = unit(jax.random.normal(keys[1], (batch, seq, key_heads, key_dim)))
    v = jax.random.normal(keys[2], (batch, seq, heads, value_dim))
    g = -jax.random.uniform(keys[3], (batch, seq, heads), maxval=0.7)
    beta = jax.random.uniform(keys[4], (batch, seq, heads))
    return q, k, v, g, beta


def test_recurrent_states_are_the_state_after_each_token():
    q, k, v, g, beta = _rule_inputs(0)
    out, final, states = gated_delta_recurrent(q, k, v, g, beta, states=True)
    chex.assert_shape(states, (2, 6, 2, 4, 3))
    for t in range(6):  # the state after t + 1 tokens is that of a call on t + 1 tokens
        _, want = gated_delta_recurrent(*(a[:, :t + 1] for a in (q, k, v, g, beta)))
        chex.assert_trees_all_close(states[:, t], want, atol=1e-6)
    chex.assert_trees_all_close((out, final),
                                gated_delta_recurrent(q, k, v, g, beta), atol=1e-6)


def _state(batch, size):
    return empty_state(batch, kernel_size=3, channels=2, heads=1, key_dim=2, value_dim=2,
                       history=size)


def _fake(lengths):
    """A recognisable state per token count n: every entry n (conv [batch, n, 2, 2], delta
    [batch, n, 1, 2, 2])."""
    lengths = jnp.asarray(lengths, jnp.float32)
    return (jnp.broadcast_to(lengths[..., None, None], (*lengths.shape, 2, 2)),
            jnp.broadcast_to(lengths[..., None, None, None], (*lengths.shape, 1, 2, 2)))


def test_record_then_rewind_returns_the_state_at_each_length():
    """Two rows fed calls of 3 (row 1's last is padding) then 2 tokens, each token's "before"
    state stamped with its length; rewinding to any length the ring holds gives that stamp."""
    size = 4
    state = _state(2, size)
    history = state.history
    mask = np.array([[True, True, True], [True, True, False]])
    history = record(history, *_fake([[0, 1, 2], [0, 1, 2]]), mask, jnp.zeros(2, jnp.int32))
    history = record(history, *_fake([[3, 4], [2, 3]]), np.ones((2, 2), bool),
                     jnp.zeros(2, jnp.int32))
    np.testing.assert_array_equal(history.length, [5, 4])
    now = DeltaState(*(jnp.full_like(a, -1.0) for a in (state.conv, state.delta)), history)
    for target, stamps in [([5, 4], [-1, -1]), ([3, 2], [3, 2]), ([1, 0], [1, 0]),
                           ([4, 9], [4, -1])]:
        rewound = rewind_state(now, jnp.asarray(target))
        np.testing.assert_array_equal(rewound.conv[:, 0, 0], stamps)
        np.testing.assert_array_equal(rewound.delta[:, 0, 0, 0], stamps)
        np.testing.assert_array_equal(rewound.history.length, np.minimum(target, [5, 4]))
    # row 0's state at length 0 left the ring of 4 (lengths 1..4 remain): NaN shows it
    assert np.isnan(rewind_state(now, jnp.asarray([0, 4])).delta[0]).all()
    # after a rewind to 2, the forgotten lengths 3, 4 are not found again
    back = rewind_state(now, jnp.asarray([2, 2]))
    fed = dataclasses.replace(back, history=dataclasses.replace(  # 2 tokens, none recorded
        back.history, length=jnp.asarray([4, 4], jnp.int32)))
    assert np.isnan(rewind_state(fed, jnp.asarray([3, 3])).conv).all()


def test_rewind_without_a_history_is_refused_by_name():
    state = _state(1, 0)
    assert state.history is None
    with pytest.raises(ValueError, match=r"init_cache\(\.\.\., rewind=n\)"):
        rewind_state(state, jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="do not fit a history of 2"):
        record(_state(1, 2).history, *_fake([[0, 1, 2]]), np.ones((1, 3), bool),
               jnp.zeros(1, jnp.int32))


def test_state_bytes():
    state = _state(3, 4)
    conv, delta = 3 * 2 * 2 * 4, 3 * 1 * 2 * 2 * 4
    assert state.nbytes == (conv + delta) * 5 + 3 * 4 * 4 + 3 * 4  # ring of 4, its lengths
    assert _state(3, 0).nbytes == conv + delta
