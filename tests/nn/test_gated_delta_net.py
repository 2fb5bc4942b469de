"""tfx.nn.GatedDeltaNet against transformers' Qwen3NextGatedDeltaNet on the same weights, and
its state: a prompt then decoding steps give what the whole sequence gives."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.nn.gated_delta_net import GatedDeltaNet

SIZES = dict(d_model=32, heads=4, key_heads=2, key_dim=8, value_dim=6, kernel_size=4)


def _layer(chunk_size=4):
    return GatedDeltaNet(SIZES["d_model"], heads=4, key_heads=2, key_dim=8, value_dim=6,
                         kernel_size=4, chunk_size=chunk_size, rngs=nnx.Rngs(0))


def _load_hf_weights(layer: GatedDeltaNet, hf) -> None:
    """transformers' fused projections, split: in_proj_qkvz's rows are [key_heads, (query,
    key, group · value, group · gate)], in_proj_ba's [key_heads, (group · β, group · decay)]."""
    group = layer.heads // layer.key_heads
    dk, dv = layer.key_dim, layer.value_dim
    qkvz = hf.in_proj_qkvz.weight.detach().numpy().T.reshape(-1, layer.key_heads,
                                                              2 * dk + 2 * group * dv)
    ba = hf.in_proj_ba.weight.detach().numpy().T.reshape(-1, layer.key_heads, 2 * group)
    cuts = np.cumsum([dk, dk, group * dv])
    for module, part in zip((layer.query, layer.key, layer.value, layer.gate),
                            np.split(qkvz, cuts, axis=-1), strict=True):
        module.kernel[...] = jnp.asarray(part.reshape(part.shape[0], -1))
    for module, part in zip((layer.beta, layer.decay), np.split(ba, 2, axis=-1), strict=True):
        module.kernel[...] = jnp.asarray(part.reshape(part.shape[0], -1))
    layer.conv[...] = jnp.asarray(hf.conv1d.weight.detach().numpy()[:, 0].T)
    layer.a_log[...] = jnp.asarray(hf.A_log.detach().numpy())
    layer.dt_bias[...] = jnp.asarray(hf.dt_bias.detach().numpy())
    layer.norm_scale[...] = jnp.asarray(hf.norm.weight.detach().numpy())
    layer.out.kernel[...] = jnp.asarray(hf.out_proj.weight.detach().numpy().T)


def test_equals_transformers_qwen3_next_gated_delta_net():
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=6,
                             linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = modeling.Qwen3NextGatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():  # non-trivial norm weights and decay biases
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.dt_bias.uniform_(-1.0, 1.0)
    layer = _layer()
    _load_hf_weights(layer, hf)
    x = np.random.default_rng(0).normal(size=(2, 11, 32)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).numpy()
    chex.assert_trees_all_close(layer(jnp.asarray(x)), want, atol=1e-4, rtol=1e-4)


def test_a_prompt_then_decoding_steps_equal_the_whole_sequence():
    layer = _layer(chunk_size=3)
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))
    whole = layer(x)
    out, state = layer(x[:, :5], layer.empty_state(2))
    outs = [out]
    for t in range(5, 9):
        out, state = layer(x[:, t:t + 1], state)
        outs.append(out)
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), whole, atol=1e-5, rtol=1e-5)
    chex.assert_shape((state.conv, state.delta), ((2, 3, 2 * 2 * 8 + 4 * 6), (2, 4, 8, 6)))


def test_bad_head_counts_are_named():
    with pytest.raises(ValueError, match=r"key_heads \(3\) must be >= 1 and divide heads"):
        GatedDeltaNet(32, heads=4, key_heads=3, key_dim=8, value_dim=6, rngs=nnx.Rngs(0))


def test_padding_leaves_both_states_as_the_real_tokens_leave_them():
    """Padding anywhere in a call (left, inside, right: chunked prefill pads a row on the
    right) gives the real tokens' outputs and the states of a call on the real tokens alone."""
    layer = _layer(chunk_size=3)
    x = jax.random.normal(jax.random.key(2), (1, 6, 32))
    start = layer(x[:, :3], layer.empty_state(1))[1]  # a state that is not zeros
    mask = np.array([[False, True, True, False, True, False, False]])
    real = x[:, 3:]  # at the mask's places, random values elsewhere
    padded = jax.random.normal(jax.random.key(3), (1, 7, 32)).at[:, mask[0]].set(real)
    out, state = layer(padded, start, token_mask=mask)
    want_out, want_state = layer(real, start)
    chex.assert_trees_all_close(out[:, mask[0]], want_out, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close((state.conv, state.delta), (want_state.conv, want_state.delta),
                                atol=1e-5, rtol=1e-5)


def test_a_history_records_the_state_before_each_token():
    """With a history of 3, a 5-token call (2 chunked, 3 token by token) keeps the states at
    lengths 2, 3, 4: those of calls on the first 2, 3, 4 tokens; outputs are unchanged."""
    layer = _layer(chunk_size=2)
    x = jax.random.normal(jax.random.key(4), (2, 5, 32))
    out, state = layer(x, layer.empty_state(2, history=3))
    plain_out, plain = layer(x, layer.empty_state(2))
    chex.assert_trees_all_close((out, state.conv, state.delta),
                                (plain_out, plain.conv, plain.delta), atol=1e-5, rtol=1e-5)
    history = state.history
    np.testing.assert_array_equal(history.length, [5, 5])
    for length in (2, 3, 4):
        _, want = layer(x[:, :length], layer.empty_state(2))
        slot = length % 3
        np.testing.assert_array_equal(history.lengths[:, slot], [length] * 2)
        chex.assert_trees_all_close((history.conv[:, slot], history.delta[:, slot]),
                                    (want.conv, want.delta), atol=1e-5, rtol=1e-5)
