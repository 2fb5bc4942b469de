"""tfx.nn.per_layer_embeddings against the per-layer-embedding formulas written out in numpy
(transformers' Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs and the end of
Gemma4TextDecoderLayer.forward), with perturbed norm scales so that every factor shows."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.nn.per_layer_embeddings import PerLayerEmbeddings, PerLayerInput

VOCAB, LAYERS, WIDTH, D, EPS = 11, 3, 4, 8, 1e-6


def _rms(x, scale):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _perturb(module, seed):
    """Every parameter moved by noise (norm scales start at ones)."""
    rng = np.random.default_rng(seed)
    for _, param in nnx.iter_graph(module):
        if isinstance(param, nnx.Param):
            param[...] = param[...] + jnp.asarray(rng.normal(0, 0.3, param[...].shape),
                                                  param[...].dtype)


def test_per_layer_inputs_follow_the_formula():
    ple = PerLayerEmbeddings(VOCAB, LAYERS, WIDTH, D, eps=EPS, rngs=nnx.Rngs(0))
    _perturb(ple, 1)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, VOCAB, (2, 5))
    embedded = rng.normal(size=(2, 5, D)).astype(np.float32)
    table = np.asarray(ple.tokens.table[...])
    kernel = np.asarray(ple.projection.kernel[...])
    scale = np.asarray(ple.norm.scale[...])
    tokens = (table[ids] * math.sqrt(WIDTH)).reshape(2, 5, LAYERS, WIDTH)
    context = (embedded @ kernel * D**-0.5).reshape(2, 5, LAYERS, WIDTH)
    expected = (_rms(context, scale) + tokens) / math.sqrt(2)
    out = ple(jnp.asarray(ids), jnp.asarray(embedded))
    assert out.shape == (2, 5, LAYERS, WIDTH)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_per_layer_input_gates_a_normalised_residual():
    layer = PerLayerInput(D, WIDTH, activation="gelu_tanh", eps=EPS, rngs=nnx.Rngs(0))
    _perturb(layer, 3)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 5, D)).astype(np.float32)
    per_layer = rng.normal(size=(2, 5, WIDTH)).astype(np.float32)
    gate, up = np.asarray(layer.gate.kernel[...]), np.asarray(layer.up.kernel[...])
    h = _gelu_tanh(x @ gate) * per_layer
    expected = x + _rms(h @ up, np.asarray(layer.norm.scale[...]))
    np.testing.assert_allclose(layer(jnp.asarray(x), jnp.asarray(per_layer)), expected,
                               rtol=1e-5, atol=1e-5)


def test_jit_gives_the_eager_numbers():
    ple = PerLayerEmbeddings(VOCAB, LAYERS, WIDTH, D, eps=EPS, rngs=nnx.Rngs(0))
    ids, embedded = jnp.arange(6).reshape(2, 3), jnp.ones((2, 3, D))
    np.testing.assert_allclose(nnx.jit(lambda m, i, e: m(i, e))(ple, ids, embedded),
                               ple(ids, embedded), rtol=1e-6, atol=1e-6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="width"):
        PerLayerEmbeddings(VOCAB, LAYERS, 0, D, eps=EPS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        PerLayerInput(D, WIDTH, activation="swish!", eps=EPS, rngs=nnx.Rngs(0))
    ple = PerLayerEmbeddings(VOCAB, LAYERS, WIDTH, D, eps=EPS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="embedded"):
        ple(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 4, D)))
    assert jax.tree.leaves(nnx.state(ple, nnx.Param))  # it has parameters to train
