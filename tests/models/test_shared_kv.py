"""Gemma 4's decoder parts in tfx's own models: keys and values shared by the last layers
(attention.shared_kv_layers), wider "full" layers (full_head_dim, full_kv_heads,
full_values_are_keys), value norms, layer scales and per-layer embeddings. The references are
the model itself run another way (whole sequences vs a KV cache filled step by step) and a
copy of the model whose sharing layers are handed the keys by hand (written out below);
transformers' own Gemma 4 is the reference of tests/hf/test_gemma4.py."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models.config import DecoderConfig
from tfx.models.decoder import Decoder
from tfx.nn.attention import NoCache, Recorded, RecordKeys, SharedKeys
from tfx.ops.positional import ProportionalScaling

KINDS = ("sliding", "full", "sliding", "sliding", "full")
CONFIG = DecoderConfig(
    vocab_size=50, d_model=32, num_layers=5, num_heads=4, d_ff=64, position="rope",
    use_bias=False, norm={"kind": "rms", "layer_scale": True},
    mlp={"gated": True, "activation": "gelu_tanh"},
    embeddings={"per_layer_width": 8, "per_layer_vocab_size": 50, "scale": True},
    rope={"local_theta": 10.0, "theta": 100.0, "scaling": ProportionalScaling(0.5)},
    attention={"num_kv_heads": 2, "value_norm": True, "qk_norm": "per_head",
               "shared_kv_layers": 2, "sliding_window": 3, "layer_types": KINDS,
               "full_head_dim": 16, "full_kv_heads": 1, "full_values_are_keys": True})
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 7)))


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


def test_sharing_layers_read_the_last_earlier_layer_of_their_type(model):
    assert model.stack.kv_sources == (None, None, None, 2, 1)
    for i in (3, 4):
        attention = model.stack.layers[i].attention
        assert (attention.key, attention.value, attention.key_norm) == (None, None, None)
    assert model.stack.layers[1].attention.value is None  # full: values are the keys
    assert model.stack.layers[1].attention.head_dim == 16
    assert model.stack.layers[0].attention.value is not None


def test_cached_decoding_gives_the_whole_sequence_logits(model):
    full = model(IDS)
    cache = model.init_cache(2, 10)
    assert [layer is None for layer in cache.layers] == [False] * 3 + [True] * 2
    assert cache.layers[1].key.shape == (2, 1, 10, 16)  # the full layer's own shape
    logits, cache = model(IDS[:, :4], cache=cache)
    steps = [logits]
    for t in range(4, 7):
        logits, cache = model(IDS[:, t:t + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_sharing_layer_attends_its_owners_keys_and_values(model):
    """Layer 3's attention output equals, written out in numpy, its own rotated queries
    attending (sliding window 3, 2 query heads per KV head, scores / sqrt(8)) the keys and
    values that layer 2 computed from its own input; and sharing changes the model (an
    unshared copy, its own projections on layers 3 and 4, gives other logits)."""
    unshared = Decoder(CONFIG.replace(attention={"shared_kv_layers": 0}), rngs=nnx.Rngs(0))
    assert not np.allclose(unshared(IDS), model(IDS), atol=1e-3)
    positions, stack = jnp.arange(7), model.stack
    x = model.embeddings(IDS, positions)
    per_layer = model.per_layer_inputs(IDS, x)
    for i in range(3):
        visibility = stack._visibility(None, stack.windows[i], False, None, positions)
        x = stack.layers[i](x, cache=RecordKeys(NoCache()) if i == 2 else None,
                            positions=positions, per_layer_input=per_layer[:, :, i],
                            **visibility)
    x, recorded = x  # layer 2 returns the keys it attended (and no cache state)
    assert isinstance(recorded, Recorded) and recorded.state is None
    owner = recorded.keys
    attention = stack.layers[3].attention
    h = stack.layers[3].attention_norm(x)
    visibility = stack._visibility(None, 3, False, None, positions)
    ours = attention(h, cache=SharedKeys(owner), positions=positions, **visibility)
    # The reference: [batch, seq, heads, dim] queries as layer 3 makes them.
    query = attention._heads(attention.query(h), 4, attention.query_norm)
    query, _ = attention.position.encode(query, None, positions, None)
    key = np.repeat(np.asarray(owner.key), 2, axis=2)  # [batch, seq, heads, dim]
    value = np.repeat(np.asarray(owner.value), 2, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", np.asarray(query), key) * 8**-0.5  # head_dim 8
    q, k = np.arange(7)[:, None], np.arange(7)[None, :]
    scores = np.where((k <= q) & (q - k < 3), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhqk,bkhd->bqhd", weights, value).reshape(2, 7, 32)
    expected = heads @ np.asarray(attention.out.kernel[...])
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)


def test_shared_and_full_layer_settings_are_checked():
    with pytest.raises(ValueError, match="shared_kv_layers"):
        CONFIG.replace(attention={"shared_kv_layers": 5})
    with pytest.raises(ValueError, match="shared_kv_layers"):  # a full sharer, no full owner
        CONFIG.replace(attention={"layer_types": ("sliding",) * 4 + ("full",),
                                  "shared_kv_layers": 1})
    with pytest.raises(ValueError, match="full_kv_heads"):
        CONFIG.replace(attention={"full_kv_heads": 3})
    with pytest.raises(ValueError, match="per_layer_width"):
        CONFIG.replace(attention={"shared_kv_layers": 0}, compute={"scan_layers": True})
    with pytest.raises(ValueError, match="per_layer_vocab_size"):
        CONFIG.replace(embeddings={"per_layer_width": None})


def test_remat_gives_the_same_logits_and_gradients(model):
    """Remat recomputes each layer apart; the owner's keys reach the sharing layers as its
    output (`Recorded`), so nothing crosses the recomputed layers but arrays."""
    remat = Decoder(CONFIG.replace(compute={"remat": True}), rngs=nnx.Rngs(0))

    def loss(m):
        return jnp.sum(m(IDS) ** 2)

    np.testing.assert_allclose(remat(IDS), model(IDS), rtol=1e-6, atol=1e-6)
    want, got = nnx.grad(loss)(model), nnx.grad(loss)(remat)
    chex.assert_trees_all_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want), rtol=1e-5,
                                atol=1e-5)


def test_the_paged_engine_decodes_shared_keys_and_refuses_wider_full_layers():
    """The engine's pools hold one page shape: shared keys and per-layer embeddings decode
    there as `tfx.generate` does; wider full layers are refused by name."""
    import tfx
    from tfx.generation.engine import Engine

    # No sliding layers (the engine refuses them); one head shape.
    uniform = CONFIG.replace(max_len=32, attention={
        "full_head_dim": None, "full_kv_heads": None, "full_values_are_keys": False,
        "layer_types": ("full",) * 5, "sliding_window": None})
    model = Decoder(uniform, rngs=nnx.Rngs(1))
    prompts = [[5, 17, 42, 8], [9, 3, 1]]
    results = Engine(model, num_pages=16, page_size=8, max_batch=2).generate(
        prompts, max_new_tokens=5)
    for prompt, result in zip(prompts, results, strict=True):
        expected = tfx.generate(model, np.array([prompt]), max_new_tokens=5, temperature=0.0,
                                eos_token_id=[])
        np.testing.assert_array_equal(result.tokens, np.asarray(expected)[0, len(prompt):])
    with pytest.raises(ValueError, match="full_head_dim"):
        Engine(Decoder(uniform.replace(attention={"full_head_dim": 16}), rngs=nnx.Rngs(0)),
               num_pages=16, page_size=8, max_batch=2)
