"""Bottleneck adapters: the adapter is h + up(act(down(h))) written out in numpy; a zero
up-projection leaves the model exactly unchanged, a small init nearly so; only adapters train;
the trainable count is (2·d·b + b + d) per adapter times the adapters per layer."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
)
from tfx.peft.adapters import Adapter, Adapters
from tfx.peft.core import PeftParam

VOCAB, D, LAYERS, B = 40, 32, 2, 4
SMALL = dict(vocab_size=VOCAB, d_model=D, num_layers=LAYERS, num_heads=4,
             attention={"num_kv_heads": 2}, d_ff=48, max_len=24)


def _ids(batch=2, seq=6, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, VOCAB)


def _trainable(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, PeftParam)))


def test_adapter_is_the_bottleneck_formula():
    adapter = Adapter(D, B, activation="relu", init_std=0.3, rngs=nnx.Rngs(0))
    adapter.down_bias[...] = jnp.linspace(-1, 1, B)
    adapter.up_bias[...] = jnp.linspace(-1, 1, D)
    h = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, D)))
    down, up = np.asarray(adapter.down[...]), np.asarray(adapter.up[...])
    expected = h + np.maximum(h @ down + np.linspace(-1, 1, B), 0) @ up + np.linspace(-1, 1, D)
    chex.assert_trees_all_close(adapter(jnp.asarray(h)), expected, atol=1e-5)


@pytest.mark.parametrize("pre_norm, scan_layers", [(True, False), (False, False), (True, True)])
def test_zero_up_projection_leaves_the_decoder_exactly_unchanged(pre_norm, scan_layers):
    model = Decoder(DecoderConfig(norm={"pre_norm": pre_norm},
                                  compute={"scan_layers": scan_layers}, **SMALL),
                    rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda model, ids: model(ids))
    ids = _ids()
    before = forward(model, ids)
    Adapters(size=B, zero_up=True).attach(model, rngs=nnx.Rngs(1))
    after = forward(model, ids)
    assert after.shape == before.shape
    # Exact in arithmetic (h + 0); the compiled program differs, so allow float32 rounding.
    chex.assert_trees_all_close(after, before, atol=1e-6)


def test_small_init_is_near_the_identity_and_a_large_one_is_not():
    forward = nnx.jit(lambda model, ids: model(ids))
    ids = _ids()
    before = forward(Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0)), ids)
    small = Adapters(size=B, init_std=1e-3).attach(Decoder(DecoderConfig(**SMALL),
                                                           rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    large = Adapters(size=B, init_std=1.0).attach(Decoder(DecoderConfig(**SMALL),
                                                          rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    chex.assert_trees_all_close(forward(small, ids), before, atol=1e-3)
    assert float(jnp.abs(forward(large, ids) - before).max()) > 1e-2


def test_an_adapter_changes_its_branch_before_the_residual():
    """Block with an mlp adapter == the Block's pieces by hand: x + A(attn(norm x)) and so on."""
    model = Decoder(DecoderConfig(**{**SMALL, "num_layers": 1}), rngs=nnx.Rngs(0))
    Adapters(size=B, init_std=0.3).attach(model, rngs=nnx.Rngs(1))
    block = model.stack.layers[0]
    x = jax.random.normal(jax.random.key(2), (2, 6, D))

    @nnx.jit
    def both(block, x):
        h = x + block.attention_adapter(block.attention(block.attention_norm(x),
                                                        is_causal=True))
        expected = h + block.mlp_adapter(block.mlp(block.mlp_norm(h)))
        return block(x, is_causal=True), expected

    out, expected = both(block, x)
    chex.assert_trees_all_close(out, expected, atol=1e-5)


@pytest.mark.parametrize("placement, per_layer", [("houlsby", 2), ("pfeiffer", 1)])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_trainable_count_is_the_formula(placement, per_layer, scan_layers):
    model = Decoder(DecoderConfig(compute={"scan_layers": scan_layers}, **SMALL), rngs=nnx.Rngs(0))
    Adapters(placement=placement, size=B).attach(model, rngs=nnx.Rngs(1))
    assert _trainable(model) == LAYERS * per_layer * (2 * D * B + B + D)


def test_reduction_and_no_bias_count():
    model = Encoder(EncoderConfig(**SMALL), rngs=nnx.Rngs(0))
    Adapters(placement="pfeiffer", reduction=8, use_bias=False).attach(model, rngs=nnx.Rngs(1))
    assert _trainable(model) == LAYERS * 2 * D * (D // 8)


def test_encoder_decoder_cross_attention_adapters():
    """Houlsby + cross: encoder layers 2 adapters, decoder layers 3."""
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL), rngs=nnx.Rngs(0))
    ids = _ids()
    forward = nnx.jit(lambda model: model(ids, decoder_input_ids=ids))
    before = forward(model)
    Adapters(size=B, zero_up=True, cross_attention=True).attach(model, rngs=nnx.Rngs(1))
    assert _trainable(model) == LAYERS * (2 + 3) * (2 * D * B + B + D)
    assert model.decoder.layers[0].cross_adapter is not None
    assert model.encoder.layers[0].cross_adapter is None
    chex.assert_trees_all_close(forward(model), before, atol=1e-6)


def test_stacked_adapters_differ_per_layer():
    model = Decoder(DecoderConfig(compute={"scan_layers": True}, **SMALL), rngs=nnx.Rngs(0))
    Adapters(size=B).attach(model, rngs=nnx.Rngs(1))
    down = model.stack.layers.mlp_adapter.down[...]
    assert down.shape == (LAYERS, D, B)
    assert not np.allclose(down[0], down[1])


@pytest.mark.parametrize("scan_layers", [False, True])
def test_only_adapters_get_gradients(scan_layers):
    model = Decoder(DecoderConfig(compute={"scan_layers": scan_layers}, **SMALL), rngs=nnx.Rngs(0))
    Adapters(size=B, zero_up=True).attach(model, rngs=nnx.Rngs(1))
    ids = _ids()

    # nnx.grad with DiffState: the frozen weights stay at the trace level of the jit, which
    # nnx.scan (scan_layers) requires of every variable of a layer.
    @nnx.jit
    def grad(model):
        def loss(model):
            return -jnp.mean(jax.nn.log_softmax(model(ids))[..., 0])
        return nnx.grad(loss, argnums=nnx.DiffState(0, PeftParam))(model)

    grads = nnx.to_pure_dict(grad(model))
    assert sum(x.size for x in jax.tree.leaves(grads)) == LAYERS * 2 * (2 * D * B + B + D)
    layers = grads["stack"]["layers"]
    up = layers["mlp_adapter"]["up"] if scan_layers else layers[0]["mlp_adapter"]["up"]
    # With a zero up-projection the down side gets no gradient yet; the up side does.
    assert float(jnp.abs(up).max()) > 0


@pytest.mark.parametrize("settings, error", [
    (dict(placement="parallel"), ValueError),
    (dict(size=0), ValueError),
    (dict(size=2.5), TypeError),
    (dict(reduction=0), ValueError),
    (dict(activation="tanh"), ValueError),
    (dict(init_std=-1.0), ValueError),
])
def test_bad_settings(settings, error):
    with pytest.raises(error):
        Adapters(**settings)


def test_bad_attach():
    model = Decoder(DecoderConfig(**SMALL), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="reduction"):
        Adapters(reduction=64).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cross-attention"):
        Adapters(size=B, cross_attention=True).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="model"):
        Adapters(size=B).attach(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
    Adapters(size=B).attach(model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already"):
        Adapters(size=B).attach(model, rngs=nnx.Rngs(0))
