"""tfx.nn.norms: every norm of tfx's models is tfx's LayerNorm or RMSNorm, whose values and
gradients are as close to the float64 formula as Flax's layers' and whose dtypes are theirs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tfx
from tfx.nn.norms import LayerNorm, RMSNorm, make_norm
from tfx.peft.core import find_modules

FLAX = {"layer": nnx.LayerNorm, "rms": nnx.RMSNorm}
RANDOM = {"scale_init": nnx.initializers.normal(1.0), "bias_init": nnx.initializers.normal(1.0)}


def pair(kind, features, **kwargs):
    """tfx's norm and Flax's, with the same random scale (and bias)."""
    init = RANDOM if kind == "layer" else {"scale_init": RANDOM["scale_init"]}
    ours = make_norm(kind, features, epsilon=1e-5, rngs=nnx.Rngs(0), **kwargs)
    theirs = FLAX[kind](features, epsilon=1e-5, rngs=nnx.Rngs(0), **init, **kwargs)
    nnx.update(ours, nnx.state(theirs))
    return ours, theirs


def textbook(kind, x, scale, bias, epsilon=1e-5):
    """The norm written out: centred (LayerNorm) or not (RMSNorm), over the last axis."""
    centred = x - jnp.mean(x, -1, keepdims=True) if kind == "layer" else x
    y = centred / jnp.sqrt(jnp.mean(centred**2, -1, keepdims=True) + epsilon) * scale
    return y + bias if kind == "layer" else y


@functools.partial(jax.jit, static_argnums=0)
def _textbook_values_and_gradients(kind, x, scale, bias):
    y, vjp = jax.vjp(lambda *a: textbook(kind, *a), x, scale, bias)
    return (y, *vjp(jnp.cos(y)))


def float64_reference(kind, x, scale, bias):
    """`textbook`'s values and the gradients of sum(sin(norm(x))) for x, scale and bias, by
    autodiff in float64 (jitted: one compilation per shape, not one per op)."""
    with jax.enable_x64(True):
        arrays = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, scale, bias))
        return [np.asarray(v) for v in _textbook_values_and_gradients(kind, *arrays)]


def _loss(module, x):
    return jnp.sum(jnp.sin(module(x)))


@nnx.jit
def values_and_gradients(module, x):
    """y, d/dx, d/dscale (and d/dbias, if the module has a bias) of sum(sin(module(x))); jitted:
    each example's shape compiles once instead of op by op."""
    params, dx = nnx.grad(_loss, argnums=(0, 1))(module, x)
    return [module(x), dx, params.scale[...]] + (
        [params.bias[...]] if "bias" in params else [])


@pytest.mark.parametrize("preset", ["char-gpt", "gpt2-small", "minilm-l6", "t5-small"])
def test_every_norm_of_a_model_is_tfx_s(preset):
    sizes = dict(d_model=32, d_ff=64, num_heads=2, num_layers=1)
    if preset == "t5-small":
        sizes["num_decoder_layers"] = 1
    model = tfx.models.create(preset, rngs=nnx.Rngs(0), **sizes)
    norms = find_modules(model, nnx.LayerNorm) + find_modules(model, nnx.RMSNorm)
    assert norms, preset
    assert {type(m) for _, m in norms} <= {LayerNorm, RMSNorm}, {type(m) for _, m in norms}


def test_query_key_norm_is_tfx_s():
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), d_model=32, d_ff=64, num_heads=2,
                              num_layers=1, attention={"qk_norm": "per_head"})
    norms = find_modules(model, nnx.RMSNorm)
    assert len(norms) > 3 and all(type(m) is RMSNorm for _, m in norms)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["layer", "rms"]),
       lead=st.lists(st.integers(1, 4), min_size=0, max_size=3), features=st.integers(1, 8),
       seed=st.integers(0, 2**16))
@example(kind="layer", lead=[2, 2, 4], features=2, seed=1)  # a row of variance near epsilon
def test_values_and_gradients_are_as_close_to_the_formula_as_flax_s(kind, lead, features, seed):
    ours, theirs = pair(kind, features)
    x = jnp.float32(3 * np.random.default_rng(seed).standard_normal((*lead, features)) + 1)
    scale = np.float64(ours.scale[...])
    bias = np.float64(ours.bias[...]) if kind == "layer" else np.zeros(features)

    # Both layers compute the variance as E[x²] - E[x]² in float32 (Flax's fast variance), and
    # round the same products in different orders. Where a row's values nearly coincide (its
    # variance near epsilon) that difference cancels, and where the true gradient is itself a
    # cancellation (2 features: exactly 0 for LayerNorm) both carry rounding noise. So each
    # value and gradient is measured against the float64 formula, and ours must be as close
    # as Flax's, to 2x and 1e-5; tests/ops/test_norms.py holds the ops to the formula itself.
    reference = float64_reference(kind, x, scale, bias)
    for mine, flax_s, exact in zip(*(values_and_gradients(m, x) for m in (ours, theirs)), reference,
                                   strict=False):
        error, flax_error = (np.max(np.abs(np.float64(g) - exact)) for g in (mine, flax_s))
        assert error <= 2 * flax_error + 1e-5, (error, flax_error)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("x_dtype, settings_", [
    (jnp.bfloat16, {}), (jnp.bfloat16, {"param_dtype": jnp.bfloat16}),
    (jnp.float32, {"dtype": jnp.bfloat16}), (jnp.bfloat16, {"dtype": jnp.float32})])
def test_dtypes_are_flax_s(kind, x_dtype, settings_):
    ours, theirs = pair(kind, 16, **settings_)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), x_dtype)
    out, expected = ours(x), theirs(x)
    chex.assert_type(out, expected.dtype)
    chex.assert_trees_all_close(out.astype(jnp.float32), expected.astype(jnp.float32),
                                atol=2e-2, rtol=2e-2)


def test_float64_under_x64():
    with jax.enable_x64(True):
        ours, _ = pair("layer", 3, param_dtype=jnp.float64)
        x = jnp.asarray([[1.0, 2.0, 4.0]], jnp.float64)
        out = ours(x)
        chex.assert_type(out, jnp.float64)
        chex.assert_trees_all_close(out, textbook("layer", x, np.float64(ours.scale[...]),
                                                  np.float64(ours.bias[...])), atol=1e-12)
