"""Prefix tuning: attention over [prefix; keys] written out in numpy, the prefix-as-past identity
on whole decoders, cached decoding and generation, scanned layers, the MLP reparameterisation,
gradients and parameter counts, and bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.nn import ALiBi, Attention
from tfx.ops import sparse
from tfx.ops.positional import alibi_slopes
from tfx.peft.core import PeftParam
from tfx.peft.prefix import EncodedPrefix, Prefix, Prefixed, PrefixKV, prefixed

G = 3  # prefix tokens
SMALL = dict(num_layers=2, d_model=32, d_ff=64, max_len=64)  # char-gpt: 4 heads, 2 KV heads


def _numpy_attention(module, x, prefix_key, prefix_value, visible, bias=None):
    """softmax(q·[pk; k]ᵀ/√d + [0 | bias], [True | visible]) · [pv; v], then ·Wo, in numpy.

    visible: bool [batch, q_len, kv_len] over the real keys; bias: [heads, q_len, kv_len].
    """
    def proj(linear, inputs):
        return np.asarray(inputs) @ np.asarray(linear.kernel[...])

    batch, q_len, _ = x.shape
    heads, kv_heads, dim = module.num_heads, module.num_kv_heads, module.head_dim
    query = proj(module.query, x).reshape(batch, q_len, heads, dim)
    key = proj(module.key, x).reshape(batch, q_len, kv_heads, dim)
    value = proj(module.value, x).reshape(batch, q_len, kv_heads, dim)
    key = np.concatenate([np.broadcast_to(prefix_key, (batch, G, kv_heads, dim)), key], axis=1)
    value = np.concatenate([np.broadcast_to(prefix_value, (batch, G, kv_heads, dim)), value], 1)
    visible = np.concatenate([np.ones((batch, q_len, G), bool), visible], axis=2)
    out = np.zeros((batch, q_len, heads, dim))
    for h in range(heads):
        kv = h // (heads // kv_heads)  # GQA: query head h reads KV head h // group
        scores = np.einsum("btd,bsd->bts", query[:, :, h], key[:, :, kv]) / np.sqrt(dim)
        if bias is not None:
            scores[:, :, G:] += bias[h]
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[:, :, h] = np.einsum("bts,bsd->btd", weights, value[:, :, kv])
    return proj(module.out, out.reshape(batch, q_len, heads * dim))


def _prefixed_attention(num_kv_heads, **kwargs):
    module = Attention(16, 4, num_kv_heads=num_kv_heads, rngs=nnx.Rngs(0), **kwargs)
    shape = (G, num_kv_heads, 4)
    prefix_key, prefix_value = (jax.random.normal(jax.random.key(i), shape) for i in (1, 2))
    prefixed(module, PrefixKV(prefix_key, prefix_value))
    return module, np.asarray(prefix_key), np.asarray(prefix_value)


CAUSAL = np.tril(np.ones((7, 7), bool))


@pytest.mark.parametrize(("num_kv_heads", "implementation"), [
    (4, "reference"), (1, "reference"), (2, "blocked")])  # MHA, MQA, GQA
def test_attention_equals_numpy_over_prefix_and_keys(num_kv_heads, implementation):
    module, prefix_key, prefix_value = _prefixed_attention(
        num_kv_heads, implementation=implementation, block_sizes=(2, 2))
    x = jax.random.normal(jax.random.key(3), (2, 7, 16))
    valid = np.ones((2, 7), bool)
    valid[1, 5:] = False  # right padding in the second row
    padding = jnp.asarray(valid[:, None, None, :])
    for kwargs, visible in [
        (dict(is_causal=True), np.broadcast_to(CAUSAL, (2, 7, 7))),
        (dict(mask=padding), np.broadcast_to(valid[:, None, :], (2, 7, 7))),
        (dict(is_causal=True, mask=padding), CAUSAL & valid[:, None, :]),
        (dict(sparsity=sparse.SlidingWindow(3)), np.broadcast_to(
            np.tril(CAUSAL, 0) & ~np.tril(CAUSAL, -3), (2, 7, 7))),
    ]:
        out = module(x, **kwargs)
        chex.assert_shape(out, (2, 7, 16))
        expected = _numpy_attention(module, x, prefix_key, prefix_value, visible)
        np.testing.assert_allclose(out, expected, atol=2e-5, err_msg=str(kwargs))


def test_segments_and_alibi_leave_the_prefix_visible_with_zero_bias():
    module, prefix_key, prefix_value = _prefixed_attention(2, position=ALiBi(4))
    x = jax.random.normal(jax.random.key(3), (2, 7, 16))
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    out = module(x, is_causal=True, query_segment_ids=segments)
    same = np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :]
    positions = np.arange(7)
    alibi = -np.asarray(alibi_slopes(4))[:, None, None] * (positions[:, None] - positions)
    expected = _numpy_attention(module, x, prefix_key, prefix_value, CAUSAL & same, alibi)
    np.testing.assert_allclose(out, expected, atol=2e-5)


def test_cross_attention_cached_context_sees_the_same_prefix():
    module, _, _ = _prefixed_attention(2)
    x = jax.random.normal(jax.random.key(3), (2, 4, 16))
    context = jax.random.normal(jax.random.key(4), (2, 6, 16))
    mask = jnp.asarray([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    chex.assert_trees_all_close(module(x, module.keys_values(context), mask=mask),
                                module(x, context, mask=mask), atol=1e-5)


# One compile per model and shape, cheaper than running the model op by op.
_forward = nnx.jit(lambda model, ids, **kwargs: model(ids, **kwargs))


def _model(prefix=None, **overrides):
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), **SMALL, **overrides)
    if prefix is not None:
        prefix.attach(model, rngs=nnx.Rngs(1))
    return model


def _prefix_of(model, past):
    """Set every layer's prefix to the cached keys/values of the first G tokens of row 0:
    the learned prefix is then exactly a past that the tokens continue."""
    def first(layer_kv):  # [(layers,) batch, kv_heads, len, dim] -> [(layers,) G, kv_heads, dim]
        return jnp.swapaxes(layer_kv[..., 0, :, :G, :], -3, -2)

    if model.config.compute.scan_layers:
        prefix = model.stack.layers.attention.prefix
        prefix.key[...], prefix.value[...] = first(past.key), first(past.value)
        return
    for block, layer in zip(model.stack.layers, past, strict=True):
        block.attention.prefix.key[...] = first(layer.key)
        block.attention.prefix.value[...] = first(layer.value)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoder_with_prefix_equals_decoder_continuing_the_prefix_tokens(scan_layers):
    """Keys/values of G real tokens (rotated by RoPE at positions 0..G-1) as the prefix, and the
    text at positions G.. : logits equal the plain model on [prefix tokens; text]."""
    plain = _model(compute={"scan_layers": scan_layers})
    tokens = jax.random.randint(jax.random.key(5), (1, G + 6), 0, 256)
    _, cache = _forward(plain, tokens[:, :G], cache=plain.init_cache(1, G))
    prefixed = _model(Prefix(G), compute={"scan_layers": scan_layers})
    _prefix_of(prefixed, cache.layers)
    logits = _forward(prefixed, tokens[:, G:], position_ids=G + jnp.arange(6)[None])
    chex.assert_shape(logits, (1, 6, 256))
    chex.assert_trees_all_close(logits, _forward(plain, tokens)[:, G:], atol=1e-4)


@pytest.mark.parametrize(("prefix", "overrides"), [
    (Prefix(G), {}),
    (Prefix(G, projection=8), dict(position="xl")),  # Transformer-XL memory as the cache
    # A ring-buffer cache shorter than the prompt.
    (Prefix(G), dict(attention={"sliding_window": 4})),
])
def test_cached_decoding_and_generate_equal_full_recompute(prefix, overrides):
    model = _model(prefix, **overrides)
    prompt = jax.random.randint(jax.random.key(6), (2, 5), 0, 256)
    # Greedy decoding without a cache: recompute every logit at each step. One buffer shape
    # (one compile): causal logits at t do not depend on the zeros after t.
    ids = jnp.pad(prompt, ((0, 0), (0, 3)))
    for t in range(5, 8):
        ids = ids.at[:, t].set(_forward(model, ids)[:, t - 1].argmax(-1))
    np.testing.assert_array_equal(tfx.generate(model, prompt, max_new_tokens=3, temperature=0.0),
                                  ids)
    if not overrides:  # the cache directly: a prompt, then one step
        logits, cache = _forward(model, prompt, cache=model.init_cache(2, 8))
        step, _ = _forward(model, ids[:, 5:6], cache=cache)
        full = _forward(model, ids)
        chex.assert_trees_all_close(logits, full[:, :5], atol=1e-4)
        chex.assert_trees_all_close(step[:, 0], full[:, 5], atol=1e-4)


def _peft_gradients(model):
    graphdef, peft, frozen = nnx.split(model, PeftParam, ...)
    ids = jnp.arange(12).reshape(2, 6)

    def loss(peft):
        # copy=True: fresh Variables for the frozen arrays too; nnx.scan (scan_layers) refuses
        # Variables created outside the grad trace next to ones created inside it.
        return jnp.mean(nnx.merge(graphdef, peft, frozen, copy=True)(ids) ** 2)

    return peft, jax.grad(loss)(peft)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_trainable_count_and_only_prefix_gets_gradients(scan_layers):
    model = _model(Prefix(G), compute={"scan_layers": scan_layers})
    peft, grads = _peft_gradients(model)
    # layers * 2 (key, value) * G * num_kv_heads * head_dim
    assert sum(x.size for x in jax.tree.leaves(peft)) == 2 * 2 * G * 2 * 8
    paths = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(grads)}
    assert all("/attention/prefix/" in f"/{p}" for p in paths) and len(paths) == 2 * (
        1 if scan_layers else 2)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_reparameterised_prefix_trains_the_mlp_and_folds_exactly():
    model = _model(Prefix(G, projection=8))
    peft, grads = _peft_gradients(model)
    # shared embedding [G, d_model], d_model -> 8 -> layers * 2 * kv_heads * head_dim
    out = 2 * 2 * 2 * 8
    assert sum(x.size for x in jax.tree.leaves(peft)) == G * 32 + 32 * 8 + 8 + 8 * out + out
    assert all(isinstance(v, PeftParam) for v in jax.tree.leaves(
        nnx.state(model, PeftParam), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    assert all(isinstance(block.attention.prefix, EncodedPrefix) for block in model.stack.layers)
    ids = jnp.arange(12).reshape(2, 6)
    before = model(ids)
    Prefix.fold(model)
    assert all(isinstance(block.attention.prefix, PrefixKV) for block in model.stack.layers)
    chex.assert_trees_all_close(model(ids), before, atol=1e-6)


def test_prefix_reaches_the_cross_attention_of_an_encoder_decoder():
    config = tfx.models.presets.PRESETS["t5-small"]
    model = tfx.models.create(config, vocab_size=64, d_model=16, num_layers=1, num_heads=2,
                              d_ff=32, dropout=0.0, rngs=nnx.Rngs(0))
    Prefix(G, targets=["cross_attention"]).attach(model, rngs=nnx.Rngs(1))
    assert len([a for _, a in nnx.iter_graph(model) if isinstance(a, Prefixed)]) == 1
    source = jnp.arange(10).reshape(2, 5)
    out = tfx.generate(model, source, max_new_tokens=3, temperature=0.0)
    chex.assert_shape(out, (2, 4))


def test_bad_input():
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
        Prefix(0)
    with pytest.raises(ValueError, match="projection must be an int >= 0"):
        Prefix(2, projection=-1)
    with pytest.raises(ValueError, match="stack/layers/0/attention"):
        Prefix(2, targets=["cross_attention"]).attach(_model(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"no tfx\.nn\.Attention"):
        Prefix(2).attach(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already have a prefix"):
        Prefix(2).attach(_model(Prefix(2)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scan_layers"):
        Prefix(2, projection=4).attach(_model(compute={"scan_layers": True}), rngs=nnx.Rngs(0))
