"""tfx.nn.LatentAttention (DeepSeek's multi-head latent attention) against the equations written
out in numpy and against Hugging Face's DeepseekV3Attention; its latent cache (decoding token by
token, a padded prompt chunk, a ring buffer) against the full causal call."""

import dataclasses
import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.nn import KVLayer, LatentAttention, Rotary, axes
from tfx.ops import dot_product_attention, sparse
from tfx.ops.kv_cache import LatentKV, LayerKV, init_cache, init_latent_cache

# VALUE != NOPE + ROPE on purpose. Few distinct weight shapes (q_a and kv_a [16, 12], q_b and
# out [12, 16]): each new one costs an initializer compile.
D_MODEL, HEADS, Q_RANK, RANK, NOPE, ROPE, VALUE = 16, 2, 12, 8, 4, 4, 6


def _module(q_lora_rank=Q_RANK, layout="interleaved", **kwargs):
    return LatentAttention(
        D_MODEL, HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=VALUE, position=Rotary(theta=10000.0, layout=layout),
        rngs=nnx.Rngs(0), **kwargs)


@functools.partial(nnx.jit, static_argnames=("is_causal", "sparsity"))
def _call(module, x, mask=None, is_causal=False, sparsity=None):
    """module(x, ...) compiled whole: faster in tests than running it op by op."""
    return module(x, mask=mask, is_causal=is_causal, sparsity=sparsity)


def _randomise_norms(module):
    """Norm scales away from 1, so that a missed or misplaced norm shows."""
    for seed, name in enumerate(("q_a_norm", "kv_a_norm")):
        if hasattr(module, name):
            scale = getattr(module, name).scale
            scale[...] = 1 + 0.5 * jax.random.normal(jax.random.key(seed), scale.shape)
    return module


def _rope(x, positions, layout, theta=10000.0):
    """x [b, s, h, d] with pair i rotated by positions · theta^(-2i/d): pairs (2i, 2i + 1)
    ("interleaved") or (i, i + d/2) ("half")."""
    d = x.shape[-1]
    angle = positions[:, :, None, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = (x[..., 0::2], x[..., 1::2]) if layout == "interleaved" else np.split(x, 2, -1)
    a, b = a * cos - b * sin, b * cos + a * sin
    if layout == "half":
        return np.concatenate([a, b], -1)
    return np.stack([a, b], -1).reshape(x.shape)


def _linear(layer, h):
    out = h @ np.asarray(layer.kernel[...], np.float64)
    return out if layer.bias is None else out + np.asarray(layer.bias[...])


def _rms(norm, h):
    scale = np.asarray(norm.scale[...], np.float64)
    return h / np.sqrt(np.mean(h ** 2, -1, keepdims=True) + norm.epsilon) * scale


def _naive_latents(module, x, layout="interleaved"):
    """float64 numpy, from the module's weights: the query [b, t, H, NOPE + ROPE] (rotary part
    rotated), latent [b, t, RANK] and rotated rope_key [b, t, 1, ROPE] at positions 0 .. t-1."""
    x = np.asarray(x, np.float64)
    (b, t, _), positions = x.shape, np.broadcast_to(np.arange(x.shape[1]), x.shape[:2])
    q = (_linear(module.query, x) if module.q_lora_rank is None
         else _linear(module.q_b, _rms(module.q_a_norm, _linear(module.q_a, x))))
    q_nope, q_rope = np.split(q.reshape(b, t, HEADS, NOPE + ROPE), [NOPE], -1)
    compressed = _linear(module.kv_a, x)
    latent = _rms(module.kv_a_norm, compressed[..., :RANK])
    rope_key = _rope(compressed[:, :, None, RANK:], positions, layout)
    return np.concatenate([q_nope, _rope(q_rope, positions, layout)], -1), latent, rope_key


def _naive(module, x, visible, layout="interleaved", softcap=None):
    """The MLA equations in float64 numpy from the module's weights; visible bool [b, 1, t, t]."""
    query, latent, rope_key = _naive_latents(module, x, layout)
    (b, t), heads = latent.shape[:2], (HEADS, -1)
    k_nope, value = np.split(_linear(module.kv_b, latent).reshape(b, t, *heads), [NOPE], -1)
    key = np.concatenate([k_nope, np.broadcast_to(rope_key, (b, t, HEADS, ROPE))], -1)
    scores = np.einsum("bthd,bshd->bhts", query, key) * module.scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshv->bthv", weights, value).reshape(b, t, HEADS * VALUE)
    return _linear(module.out, out)


def _causal_padded(lengths, t):
    """bool [b, 1, t, t]: causal, keys past each row's length hidden (right padding)."""
    keys = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    return np.tril(np.ones((t, t), bool))[None, None] & keys[:, None, None, :]


@pytest.mark.parametrize(("q_lora_rank", "absorb"), [(None, False), (Q_RANK, False),
                                                   (Q_RANK, True)])
def test_matches_the_equations_causal_with_padding(q_lora_rank, absorb):
    module = _randomise_norms(_module(q_lora_rank, use_bias=True, absorb=absorb))
    x = jax.random.normal(jax.random.key(1), (2, 7, D_MODEL))
    key_valid = jnp.arange(7)[None, :] < jnp.array([7, 4])[:, None]
    out = _call(module, x, key_valid[:, None, None, :], is_causal=True)
    chex.assert_trees_all_close(out, _naive(module, x, _causal_padded([7, 4], 7)), atol=2e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_matches_hugging_face_deepseek_v3(layout):
    """HF rope_interleave=True permutes each rotary part's pairs before rotate_half; the same
    permutation of q and k leaves every score as tfx's "interleaved" layout gives it."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = hf.DeepseekV3Config(
        hidden_size=D_MODEL, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=Q_RANK,
        kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VALUE,
        rope_interleave=layout == "interleaved", attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    ours = _randomise_norms(_module(Q_RANK, layout, use_bias=True, norm_eps=config.rms_norm_eps))
    for name, hf_name in (("q_a", "q_a_proj"), ("q_b", "q_b_proj"), ("kv_b", "kv_b_proj"),
                          ("kv_a", "kv_a_proj_with_mqa"), ("out", "o_proj")):
        layer, hf_layer = getattr(ours, name), getattr(theirs, hf_name)
        layer.kernel[...] = jnp.asarray(hf_layer.weight.detach().numpy().T)
        if layer.bias is not None:
            layer.bias[...] = jnp.asarray(hf_layer.bias.detach().numpy())
    for name, hf_name in (("q_a_norm", "q_a_layernorm"), ("kv_a_norm", "kv_a_layernorm")):
        getattr(theirs, hf_name).weight.data = torch.tensor(
            np.asarray(getattr(ours, name).scale[...]))
    x = np.random.default_rng(0).standard_normal((2, 6, D_MODEL)).astype(np.float32)
    visible = _causal_padded([6, 4], 6)
    with torch.no_grad():
        position_ids = torch.arange(6)[None].expand(2, -1)
        cos_sin = hf.DeepseekV3RotaryEmbedding(config)(torch.tensor(x), position_ids)
        additive = torch.tensor(np.where(visible, 0.0, -1e9).astype(np.float32))
        expected, _ = theirs(torch.tensor(x), position_embeddings=cos_sin,
                             attention_mask=additive)
    out = _call(ours, jnp.asarray(x), jnp.asarray(visible))
    chex.assert_trees_all_close(out, expected.numpy(), atol=2e-5)


@nnx.jit
def _step(module, cache, x, valid):
    """One cached call of `module` (a one-layer model): plan, attend, store the layer back."""
    step, cache = cache.plan(valid)
    out, layer = module(x, cache=KVLayer(cache.layers[0], step))
    return out, dataclasses.replace(cache, layers=(layer,))


@pytest.mark.parametrize("absorb", [None, False])  # steps: None chooses absorbed
def test_token_by_token_equals_the_full_causal_call(absorb):
    module = _module(absorb=absorb)
    x = jax.random.normal(jax.random.key(1), (2, 6, D_MODEL))
    cache = init_latent_cache(num_layers=1, batch=2, max_len=8, kv_lora_rank=RANK,
                              qk_rope_head_dim=ROPE)
    outs = []
    for t in range(6):
        out, cache = _step(module, cache, x[:, t:t + 1], jnp.ones((2, 1), bool))
        outs.append(out)
    expected = _call(module, x, is_causal=True)
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), expected, atol=2e-5)


@pytest.mark.parametrize("absorb", [None, False])
def test_right_padded_prompt_chunk_then_steps(absorb):
    """Rows of 5 and 3 prompt tokens in one padded chunk, then 3 new tokens each: every real
    token's output is the full causal call's on that row's tokens alone."""
    module = _module(absorb=absorb)
    x = jax.random.normal(jax.random.key(1), (2, 8, D_MODEL))
    lengths = (5, 3)
    valid = jnp.arange(5)[None, :] < jnp.array(lengths)[:, None]
    cache = init_latent_cache(num_layers=1, batch=2, max_len=10, kv_lora_rank=RANK,
                              qk_rope_head_dim=ROPE)
    prompt_out, cache = _step(module, cache, x[:, :5], valid)
    outs = []
    for t in range(5, 8):
        out, cache = _step(module, cache, x[:, t:t + 1], jnp.ones((2, 1), bool))
        outs.append(out)
    for row, length in enumerate(lengths):
        tokens = jnp.concatenate([x[row, :length], x[row, 5:]])[None]
        expected = _call(module, tokens, is_causal=True)[0]
        chex.assert_trees_all_close(prompt_out[row, :length], expected[:length], atol=2e-5)
        chex.assert_trees_all_close(jnp.concatenate(outs, 1)[row], expected[length:], atol=2e-5)


def test_ring_buffer_equals_a_sliding_window():
    """A window of 3 slots: a chunk of 4 (attending [old cache | chunk]), then steps past it."""
    module = _module()
    x = jax.random.normal(jax.random.key(1), (1, 7, D_MODEL))
    cache = init_latent_cache(num_layers=1, batch=1, max_len=16, kv_lora_rank=RANK,
                              qk_rope_head_dim=ROPE, window=3)
    assert cache.layers[0].latent.shape == (1, 1, 3, RANK)
    out, cache = _step(module, cache, x[:, :4], jnp.ones((1, 4), bool))
    outs = [out]
    for t in range(4, 7):
        out, cache = _step(module, cache, x[:, t:t + 1], jnp.ones((1, 1), bool))
        outs.append(out)
    chex.assert_trees_all_close(jnp.concatenate(outs, 1),
                                _call(module, x, sparsity=sparse.SlidingWindow(3)), atol=2e-5)


def test_cache_holds_only_the_latent_and_the_rotated_key():
    module = _module()
    x = jax.random.normal(jax.random.key(1), (2, 3, D_MODEL))
    cache = init_latent_cache(num_layers=1, batch=2, max_len=8, kv_lora_rank=RANK,
                              qk_rope_head_dim=ROPE)
    for t in range(3):
        _, cache = _step(module, cache, x[:, t:t + 1], jnp.ones((2, 1), bool))
    layer = cache.layers[0]
    assert isinstance(layer, LatentKV) and len(jax.tree.leaves(layer)) == 2
    chex.assert_shape([layer.latent, layer.rope_key], [(2, 1, 8, RANK), (2, 1, 8, ROPE)])
    _, latent, rope_key = _naive_latents(module, x)
    chex.assert_trees_all_close(layer.latent[:, 0, :3], latent, atol=1e-5)
    chex.assert_trees_all_close(layer.rope_key[:, 0, :3], rope_key[:, :, 0], atol=1e-5)
    np.testing.assert_array_equal(layer.latent[:, :, 3:], 0)


def test_bytes_per_token_latent_against_full_keys_and_values():
    latent = init_latent_cache(num_layers=3, batch=2, max_len=8, kv_lora_rank=RANK,
                               qk_rope_head_dim=ROPE, dtype=jnp.bfloat16, stacked=True)
    assert latent.layers.latent.shape == (3, 2, 1, 8, RANK)
    assert latent.layers.rope_key.shape == (3, 2, 1, 8, ROPE)
    assert latent.bytes_per_token == 3 * (RANK + ROPE) * 2
    assert latent.take(jnp.array([1, 1, 0])).layers.latent.shape == (3, 3, 1, 8, RANK)
    # The same attention's keys and values in full: H heads of NOPE + ROPE and VALUE features.
    full = init_cache(num_layers=3, batch=2, max_len=8, num_kv_heads=HEADS, head_dim=8,
                      dtype=jnp.bfloat16)
    assert full.bytes_per_token == 3 * 2 * HEADS * 8 * 2


def test_gradients_flow_to_every_weight():
    module = _randomise_norms(_module(use_bias=True))
    x = jax.random.normal(jax.random.key(1), (2, 5, D_MODEL))

    def loss(module):
        return jnp.sum(module(x, is_causal=True) ** 2)

    grads = nnx.jit(nnx.grad(loss))(module)
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(grad)) and np.any(grad != 0), path


@pytest.mark.parametrize("absorb", [False, True])
def test_blocked_kernel_gives_the_reference_values(absorb):
    """Both forms on tiles: per-head values wider than keys, or one shared key/value head."""
    x = jax.random.normal(jax.random.key(1), (2, 12, D_MODEL))
    mask = (jnp.arange(12)[None, :] < jnp.array([12, 9])[:, None])[:, None, None, :]
    blocked = _module(implementation="blocked", block_sizes=(4, 4), absorb=absorb)
    reference = _module(implementation="reference", absorb=absorb)
    chex.assert_trees_all_close(_call(blocked, x, mask, is_causal=True),
                                _call(reference, x, mask, is_causal=True), atol=2e-5)


@pytest.mark.skipif("softcap" not in inspect.signature(dot_product_attention).parameters,
                    reason="tfx.ops.dot_product_attention has no softcap yet")
def test_softcap_caps_the_scores():
    module = _module(softcap=0.5)
    x = jax.random.normal(jax.random.key(1), (2, 5, D_MODEL))
    expected = _naive(module, x, _causal_padded([5, 5], 5), softcap=0.5)
    chex.assert_trees_all_close(_call(module, x, is_causal=True), expected, atol=2e-5)


def test_weights_name_their_logical_axes():
    module = _module()
    names = {name: getattr(module, name).kernel.get_metadata(axes.KEY)
             for name in ("q_a", "q_b", "kv_a", "kv_b", "out")}
    assert names == {"q_a": ("embed", None), "q_b": (None, "heads"), "kv_a": ("embed", None),
                     "kv_b": (None, "heads"), "out": ("heads", "embed")}


@pytest.mark.parametrize("bad", ["q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                 "v_head_dim"])
def test_bad_sizes_name_the_argument(bad):
    sizes = dict(q_lora_rank=Q_RANK, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                 qk_rope_head_dim=ROPE, v_head_dim=VALUE)
    with pytest.raises(ValueError, match=bad):
        LatentAttention(D_MODEL, HEADS, **{**sizes, bad: 0}, rngs=nnx.Rngs(0))


def test_a_cache_of_full_keys_or_other_widths_is_refused():
    module, x = _module(), jnp.zeros((1, 1, D_MODEL))
    full = LayerKV(jnp.zeros((1, HEADS, 4, 8)), jnp.zeros((1, HEADS, 4, 8)))
    with pytest.raises(ValueError, match="LatentKV"):  # refused before the step is read
        module(x, cache=KVLayer(full, step=None))
    other = LatentKV(jnp.zeros((1, 1, 4, RANK + 1)), jnp.zeros((1, 1, 4, ROPE)))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        module(x, cache=KVLayer(other, step=None))


@pytest.mark.parametrize("bad", ["kv_lora_rank", "qk_rope_head_dim", "batch"])
def test_init_latent_cache_rejects_bad_sizes(bad):
    sizes = dict(num_layers=2, batch=1, max_len=4, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    with pytest.raises(ValueError, match=bad):
        init_latent_cache(**{**sizes, bad: 0})
