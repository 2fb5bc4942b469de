"""Models built from every preset: shapes, functional use, configuration errors, and the pieces
(embeddings, MLP, norms, blocks) against written-out formulas."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import PRESETS, Decoder, DecoderConfig, Encoder, EncoderDecoder, create
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.mlp import MLP

SMALL = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, vocab_size=97)


def _small(name):
    overrides = dict(SMALL)
    if PRESETS[name].attention.num_kv_heads:
        overrides["attention"] = {"num_kv_heads": 2}
    return create(name, rngs=nnx.Rngs(0), dropout=0.0, **overrides)


def _call(model, ids, **kwargs):
    if isinstance(model, EncoderDecoder):
        return model(ids, decoder_input_ids=ids[:, :5], **kwargs)
    return model(ids, **kwargs)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_runs(name):
    model = _small(name)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 97)
    out = _call(model, ids, attention_mask=jnp.ones((2, 9), bool))
    width = 32 if isinstance(model, Encoder) else 97  # hidden states vs logits
    chex.assert_shape(out, (2, 5 if isinstance(model, EncoderDecoder) else 9, width))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))

    graphdef, state = nnx.split(model)

    @jax.jit
    def apply(state, ids):
        return _call(nnx.merge(graphdef, state), ids)

    chex.assert_trees_all_close(apply(state, ids), _call(model, ids), atol=1e-5)


def test_presets_have_the_published_sizes():
    def count(name):  # of abstract parameters: a count needs shapes, not 234M random values
        model = nnx.eval_shape(lambda: create(name, rngs=nnx.Rngs(0)))
        return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    # BERT-base: 109.5M with pooler; the tfx encoder adds the 0.6M MLM transform and bias.
    assert abs(count("bert-base") - 110.1e6) < 0.2e6
    assert abs(count("gpt2-small") - 124.4e6) < 0.1e6  # GPT-2 small: 124M, tied head


def test_decoder_is_causal():
    model = _small("char-gpt")
    ids = jax.random.randint(jax.random.key(1), (1, 10), 0, 97)
    changed = ids.at[0, 7].set((ids[0, 7] + 1) % 97)
    a, b = model(ids), model(changed)
    chex.assert_trees_all_close(a[:, :7], b[:, :7], atol=1e-6)
    assert float(jnp.max(jnp.abs(a[:, 7:] - b[:, 7:]))) > 1e-4


def test_sliding_window_limits_how_far_back_a_token_sees():
    config = PRESETS["llama-tiny"].replace(**SMALL, attention={"num_kv_heads": 2})
    model = Decoder(config.replace(attention={"sliding_window": 3}), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (1, 12), 0, 97)
    changed = ids.at[0, 2].set((ids[0, 2] + 1) % 97)
    diff = jnp.max(jnp.abs(model(ids) - model(changed)), axis=-1)[0]
    # With 2 layers of window 3, token 2 reaches positions 2 .. 6 and no further.
    assert bool(jnp.all(diff[:2] < 1e-6)) and bool(jnp.all(diff[2:7] > 1e-6))
    assert bool(jnp.all(diff[7:] < 1e-6))


def test_padding_does_not_change_real_tokens():
    model = _small("bert-base")
    ids = jax.random.randint(jax.random.key(3), (1, 6), 1, 97)
    padded = jnp.concatenate([ids, jnp.zeros((1, 3), ids.dtype)], axis=1)
    mask = jnp.array([[1] * 6 + [0] * 3])
    chex.assert_trees_all_close(model(padded, attention_mask=mask)[:, :6], model(ids),
                                atol=1e-5)


def test_one_hot_embedding_equals_gather():
    gather = TokenEmbedding(50, 8, rngs=nnx.Rngs(0))
    one_hot = TokenEmbedding(50, 8, one_hot=True, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 7, 49, 7]])
    chex.assert_trees_all_close(one_hot(ids), gather(ids), atol=1e-6)
    np.testing.assert_allclose(gather(ids)[0, 1], gather.table[...][7])


def test_scaled_embeddings_are_the_table_times_sqrt_d_model_plus_sinusoids():
    # Vaswani et al. 2017, 3.4: embeddings multiplied by sqrt(d_model), then sinusoids added.
    config = DecoderConfig(vocab_size=40, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                           position="sinusoidal", embeddings={"scale": True})
    model = Decoder(config, rngs=nnx.Rngs(0))
    ids = jnp.array([[3, 0, 39, 3, 7]])
    position = np.arange(5)[:, None]
    angle = position / 10000 ** (np.arange(0, 16, 2) / 16)
    sinusoids = np.zeros((5, 16))
    sinusoids[:, 0::2], sinusoids[:, 1::2] = np.sin(angle), np.cos(angle)
    table = np.asarray(model.embeddings.tokens.table[...])
    chex.assert_trees_all_close(model.embeddings(ids, jnp.arange(5))[0],
                                table[ids[0]] * 4.0 + sinusoids, atol=1e-5)
    with pytest.raises(TypeError, match=r"embeddings\.scale must be a bool"):
        config.replace(embeddings={"scale": 1})


@pytest.mark.parametrize("activation,gated,reference", [
    ("gelu", False, lambda x: 0.5 * x * (1 + jax.scipy.special.erf(x / np.sqrt(2)))),
    ("gelu_tanh", False,
     lambda x: 0.5 * x * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))),
    ("relu", False, lambda x: jnp.maximum(x, 0)),
    ("silu", True, lambda x: x / (1 + jnp.exp(-x))),
])
def test_mlp_matches_written_out(activation, gated, reference):
    mlp = MLP(8, 16, activation=activation, gated=gated, use_bias=not gated, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (2, 3, 8))

    def linear(layer, h):
        out = h @ layer.kernel[...]
        return out if layer.bias is None else out + layer.bias[...]

    hidden = reference(linear(mlp.up, x)) if not gated else (
        reference(linear(mlp.gate, x)) * linear(mlp.up, x))
    chex.assert_trees_all_close(mlp(x), linear(mlp.down, hidden), atol=1e-5)


def test_bfloat16_compute_runs_on_cpu():
    model = create("char-gpt", rngs=nnx.Rngs(0), num_layers=1, compute={"dtype": "bfloat16"})
    logits = model(jnp.ones((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32
    assert model.embeddings.tokens.table[...].dtype == jnp.float32


def test_remat_gives_the_same_gradients():
    plain = create("char-gpt", rngs=nnx.Rngs(0), num_layers=2)
    remat = create("char-gpt", rngs=nnx.Rngs(0), num_layers=2, compute={"remat": True})
    ids = jnp.arange(16)[None] % 256

    def loss(model):
        return jnp.mean(model(ids) ** 2)

    chex.assert_trees_all_close(nnx.grad(loss)(remat), nnx.grad(loss)(plain), atol=1e-6)


@pytest.mark.parametrize("overrides,error,match", [
    ({"attention": {"num_kv_heads": 3}}, ValueError,
     r"attention.num_kv_heads \(3\) must divide num_heads \(4\)"),
    ({"d_model": 30}, ValueError, r"d_model \(30\) must be divisible by num_heads \(4\)"),
    ({"position": "xpos"}, ValueError, "position must be one of"),
    ({"mlp": {"activation": "swish"}}, ValueError, "mlp.activation must be one of"),
    ({"norm": {"kind": "batch"}}, ValueError, "norm.kind must be one of"),
    ({"norm": {"eps": 0.0}}, ValueError, "norm.eps must be > 0"),
    ({"num_layers": 0}, ValueError, "num_layers must be >= 1"),
    ({"d_ff": 64.0}, TypeError, "d_ff must be an int"),
    ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
    ({"attention": {"sliding_window": 0}}, ValueError, "attention.sliding_window must be >= 1"),
    ({"attention": {"implementation": "flash"}}, ValueError,
     "attention.implementation must be one of"),
    ({"rope": {"fraction": 0.0}}, ValueError, r"rope.fraction must be in \(0, 1\]"),
    ({"rope": {"layout": "zigzag"}}, ValueError, "rope.layout must be one of"),
    ({"compute": {"dtype": "int8"}}, ValueError, "compute.dtype must be one of"),
    ({"embeddings": {"scale": 1}}, TypeError, "embeddings.scale must be a bool"),
    ({"position": "learned", "rope": {}}, ValueError, "rope holds the settings of"),
    ({"norm": "rms"}, TypeError, "norm must be a NormConfig"),
])
def test_bad_config(overrides, error, match):
    with pytest.raises(error, match=match):
        PRESETS["char-gpt"].replace(**{**SMALL, **overrides})


def test_bad_calls():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        create("gpt5")
    with pytest.raises(TypeError, match="config must be a preset name"):
        create({"d_model": 3})
    model = _small("char-gpt")
    with pytest.raises(ValueError, match=r"input_ids must be int \[batch, seq\]"):
        model(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="exceeds the learned position table"):
        _small("gpt2-small")(jnp.ones((1, 2048), jnp.int32))


@pytest.mark.parametrize("name", ["char-gpt", "bert-base", "t5-small"])
def test_scanned_layers_compute_what_the_layer_list_computes(name):
    """scan_layers=True stacks the same weights [num_layers, ...] and runs them in nnx.scan."""
    from tfx.hf.io import assign_params, flat_params, stack_layers

    overrides = {**SMALL, "num_layers": 3, "dropout": 0.0}
    if PRESETS[name].attention.num_kv_heads:
        overrides["attention"] = {"num_kv_heads": 2}
    listed = create(name, rngs=nnx.Rngs(0), **overrides)
    scanned = create(name, rngs=nnx.Rngs(1), compute={"scan_layers": True}, **overrides)
    assign_params(scanned, stack_layers(flat_params(listed)), source="test")
    ids = jax.random.randint(jax.random.key(5), (2, 7), 0, 97)

    def loss(model):
        return jnp.mean(_call(model, ids) ** 2)

    chex.assert_trees_all_close(_call(scanned, ids), _call(listed, ids), atol=1e-5)
    grads = stack_layers({p: np.asarray(v) for p, v in
                          nnx.to_flat_state(nnx.grad(loss)(listed))})
    scanned_grads = {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.grad(loss)(scanned))}
    chex.assert_trees_all_close(scanned_grads, grads, atol=1e-5)


def test_token_types_from_separators():
    """[CLS] A A [SEP] B B [SEP] [PAD]: types 0 through the first [SEP], 1 after (BERT)."""
    from tfx.models import token_types_from_separators

    ids = jnp.array([[101, 7, 8, 102, 9, 10, 102, 0], [101, 7, 102, 0, 0, 0, 0, 0]])
    types = token_types_from_separators(ids, 102)
    np.testing.assert_array_equal(types, [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])


def test_scanned_model_trains_functionally_with_the_rest_of_the_state_closed_over():
    """The usual training-step pattern: only parameters are traced arguments."""
    model = create("char-gpt", rngs=nnx.Rngs(0), num_layers=2, compute={"scan_layers": True})
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss(params, ids):
        return jnp.mean(nnx.merge(graphdef, params, rest)(ids) ** 2)

    grads = jax.grad(loss)(params, jnp.arange(8)[None])
    assert grads["stack"]["layers"]["mlp"]["up"]["kernel"][...].shape[0] == 2
