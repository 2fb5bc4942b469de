"""Soft prompts (prompt tuning): the prompted model equals the model run by hand on
[prompt vectors; token embeddings] at positions 0.. G+seq-1 with the prompt positions dropped;
the KV cache holds the prompt so generation equals greedy recomputation; only the prompt trains."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tfx
from tfx.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
)
from tfx.peft.core import PeftParam
from tfx.peft.prompt import SoftPrompt

G, VOCAB, D = 3, 40, 32
SMALL = dict(vocab_size=VOCAB, d_model=D, num_layers=2, num_heads=4,
             attention={"num_kv_heads": 2}, d_ff=48, max_len=24)


def _ids(batch=2, seq=6, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, VOCAB)


def _prompted(model, **settings):
    return SoftPrompt(**({"num_tokens": G} | settings)).attach(model, rngs=nnx.Rngs(7))


def _hand_embeddings(model_embeddings, vectors, ids, token_types=False):
    """[prompt; tokens] + positions 0..G+seq-1 (+ token type 0), then the embedding norm."""
    batch, seq = ids.shape
    x = jnp.concatenate([jnp.broadcast_to(vectors, (batch, G, D)),
                         model_embeddings.tokens.table[...][ids]], axis=1)
    if model_embeddings.positions is not None:
        x = x + model_embeddings.positions.table[...][jnp.arange(G + seq)]
    if token_types:
        x = x + model_embeddings.token_types.table[...][0]
    return x if model_embeddings.norm is None else model_embeddings.norm(x)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_decoder_logits_equal_the_layers_on_prompt_then_tokens(position):
    model = _prompted(Decoder(DecoderConfig(position=position, **SMALL), rngs=nnx.Rngs(0)))

    @nnx.jit  # one compiled program rather than many eager ops: fast on a small CPU
    def both(model, ids):
        x = _hand_embeddings(model.embeddings, model.embeddings.prompt.vectors[...], ids)
        hidden = model.stack(x, positions=jnp.arange(G + ids.shape[1]))
        return model(ids), model.logits(hidden[:, G:])

    logits, expected = both(model, _ids())
    assert logits.shape == (2, 6, VOCAB)
    chex.assert_trees_all_close(logits, expected, atol=1e-6)


def test_decoder_padding_columns_of_the_prompt_are_attended():
    """A right-padded row gives the logits of the same row alone, unpadded."""
    model = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)))
    ids = _ids(batch=1, seq=6)
    mask = jnp.array([[1, 1, 1, 1, 0, 0]])
    padded = nnx.jit(lambda model: model(ids, attention_mask=mask)[:, :4])(model)
    alone = nnx.jit(lambda model: model(ids[:, :4]))(model)
    chex.assert_trees_all_close(padded, alone, atol=1e-5)


def test_encoder_hidden_equals_the_layers_on_prompt_then_tokens():
    # BERT: the embedding norm covers the prompt.
    config = EncoderConfig(norm={"pre_norm": False}, **SMALL)
    model = _prompted(Encoder(config, rngs=nnx.Rngs(0)))

    @nnx.jit
    def both(model, ids):
        x = _hand_embeddings(model.embeddings, model.embeddings.prompt.vectors[...], ids,
                             token_types=True)
        return model(ids), model.stack(x, positions=jnp.arange(G + 6))[:, G:]

    out, expected = both(model, _ids())
    assert out.shape == (2, 6, D)
    chex.assert_trees_all_close(out, expected, atol=1e-5)


def test_encoder_decoder_decoder_attends_to_the_prompt_in_the_encoder_output():
    model = _prompted(EncoderDecoder(EncoderDecoderConfig(position="t5", **SMALL),
                                     rngs=nnx.Rngs(0)))
    ids, targets = _ids(), _ids(seed=2, seq=4)
    mask = jnp.array([[1] * 6, [1] * 4 + [0] * 2])
    # The prompt columns are always attended, in the encoder and by the cross-attention.
    context_mask = jnp.concatenate([jnp.ones((2, G), bool), mask.astype(bool)],
                                   axis=1)[:, None, None, :]

    @nnx.jit
    def both(model):
        embeddings = model.encoder_embeddings
        x = _hand_embeddings(embeddings, embeddings.prompt.vectors[...], ids)
        encoded = model.encoder(x, positions=jnp.arange(G + 6), mask=context_mask)
        hidden = model.decoder(model.decoder_embeddings(targets, jnp.arange(4)),
                               positions=jnp.arange(4), context=encoded,
                               context_mask=context_mask)
        return (model.encode(ids, attention_mask=mask), encoded,
                model(ids, decoder_input_ids=targets, attention_mask=mask), model._logits(hidden))

    encoded, expected_encoded, logits, expected_logits = both(model)
    assert encoded.shape == (2, G + 6, D)
    chex.assert_trees_all_close(encoded, expected_encoded, atol=1e-5)
    chex.assert_trees_all_close(logits, expected_logits, atol=1e-5)


def _greedy_by_recomputation(model, ids, steps):
    """Greedy decoding by running the whole sequence at every step. The sequence is padded to
    its final length once (causal: the padding after position t does not change its logits),
    so one compiled program serves every step."""
    length = ids.shape[1]
    ids = jnp.pad(ids, ((0, 0), (0, steps)))
    logits_of = nnx.jit(lambda model, ids: model(ids))
    for t in range(length, length + steps):
        ids = ids.at[:, t].set(jnp.argmax(logits_of(model, ids)[:, t - 1], axis=-1))
    return ids


@pytest.mark.parametrize("scan_layers", [pytest.param(False, marks=pytest.mark.slow), True])
def test_generate_equals_greedy_recomputation(scan_layers):
    model = _prompted(Decoder(DecoderConfig(position="rope", compute={"scan_layers": scan_layers},
                                            **SMALL), rngs=nnx.Rngs(0)), init="vocab")
    ids = _ids(seq=5)
    out = tfx.generate(model, ids, max_new_tokens=4, temperature=0.0, bucket=False)
    np.testing.assert_array_equal(out, _greedy_by_recomputation(model, ids, 4))


def test_cache_holds_the_prompt_and_cached_logits_equal_full_ones():
    model = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)))
    ids = _ids()

    @nnx.jit
    def cached_and_full(model):
        cache = model.init_cache(2, 8)
        return cache, model(ids, cache=cache)[0], model(ids)

    cache, cached, full = cached_and_full(model)
    assert cache.positions.shape == (2, 8 + G)
    np.testing.assert_array_equal(cache.next_position, [G, G])
    chex.assert_trees_all_close(cached, full, atol=1e-5)


def test_encoder_decoder_generate_runs_with_a_prompt():
    model = _prompted(EncoderDecoder(EncoderDecoderConfig(**SMALL), rngs=nnx.Rngs(0)))
    ids = _ids()
    out = tfx.generate(model, ids, max_new_tokens=3, temperature=0.0)
    targets = out[:, :3]
    logits = model(ids, decoder_input_ids=targets)
    np.testing.assert_array_equal(out[:, 1:], jnp.argmax(logits, axis=-1))


def test_only_the_prompt_is_trainable_and_gets_gradients():
    model = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)))
    ids = _ids()
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, PeftParam))) == G * D

    @nnx.jit
    def grad(model):
        def loss(model):
            return -jnp.mean(jax.nn.log_softmax(model(ids))[..., 0])
        return nnx.grad(loss, argnums=nnx.DiffState(0, PeftParam))(model)

    (grad,) = jax.tree.leaves(grad(model))
    assert grad.shape == (G, D) and float(jnp.abs(grad).min()) > 0


def test_initialisations():
    model = Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0))
    table = model.embeddings.tokens.table[...]
    text = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)), num_tokens=5,
                     init="text", text_ids=(4, 9))
    np.testing.assert_array_equal(text.embeddings.prompt.vectors[...],
                                  table[jnp.array([4, 9, 4, 9, 4])])
    vocab = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)), init="vocab")
    rows = vocab.embeddings.prompt.vectors[...]
    assert all(bool(jnp.any(jnp.all(table == row, axis=1))) for row in rows)
    random = _prompted(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)), init_std=0.5)
    assert 0.2 < float(jnp.std(random.embeddings.prompt.vectors[...])) < 1.0


@pytest.mark.parametrize("settings, error", [
    (dict(num_tokens=0), ValueError),
    (dict(num_tokens=2.0), TypeError),
    (dict(num_tokens=2, init="zeros"), ValueError),
    (dict(num_tokens=2, init="text"), ValueError),
    (dict(num_tokens=2, init="text", text_ids=()), ValueError),
    (dict(num_tokens=2, text_ids=(1,)), ValueError),
    (dict(num_tokens=2, init_std=0.0), ValueError),
])
def test_bad_settings(settings, error):
    with pytest.raises(error):
        SoftPrompt(**settings)


def test_bad_attach():
    model = Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0))  # learned positions, max_len 24
    with pytest.raises(ValueError, match="max_len"):
        SoftPrompt(num_tokens=24).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size"):
        SoftPrompt(num_tokens=2, init="text", text_ids=(VOCAB,)).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="model"):
        SoftPrompt(num_tokens=2).attach(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
    _prompted(model)
    with pytest.raises(ValueError, match="already"):
        _prompted(model)
    with pytest.raises(ValueError, match="leading vectors"):
        model(_ids(seq=24 - G + 1))
    with pytest.raises(ValueError, match="leading vectors"):
        model.init_cache(2, 24 - G + 1)
    with pytest.raises(ValueError, match="segment_ids"):
        model(_ids(), segment_ids=jnp.zeros((2, 6), jnp.int32))
