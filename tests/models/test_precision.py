"""Mixed precision by platform: config.dtype None means bfloat16 compute on GPU/TPU and float32 on
CPU (platforms faked by name), parameters stay float32, and a bfloat16 model still computes its
softmax statistics (attention, router) and router logits in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import DecoderConfig, create
from tfx.models.block import dtypes
from tfx.models.config import compute_dtype

TINY = DecoderConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, d_ff=64, max_len=32,
                     position="rope", norm={"kind": "rms"},
                     mlp={"activation": "silu", "gated": True})
TINY_MOE = TINY.replace(moe={"num_experts": 4, "experts_per_token": 2})


@pytest.mark.parametrize("config_dtype, platform, expected", [
    (None, "cpu", None), (None, "gpu", jnp.bfloat16), (None, "cuda", jnp.bfloat16),
    (None, "rocm", jnp.bfloat16), (None, "tpu", jnp.bfloat16), (None, "TPU", jnp.bfloat16),
    (None, "METAL", None),  # platforms without a known fast bfloat16 path keep float32
    ("float32", "tpu", jnp.float32), ("float32", "gpu", jnp.float32),
    ("bfloat16", "cpu", jnp.bfloat16), ("float16", "gpu", jnp.float16),
])
def test_compute_dtype_by_platform(config_dtype, platform, expected):
    got = compute_dtype(config_dtype, platform)
    assert got is None if expected is None else got == jnp.dtype(expected)


def test_compute_dtype_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be one of"):
        compute_dtype("float64", "gpu")
    with pytest.raises(TypeError, match="platform must be a platform name"):
        compute_dtype(None, None)


@pytest.mark.parametrize("platform, expected", [("cpu", None), ("gpu", jnp.bfloat16),
                                                ("tpu", jnp.bfloat16)])
def test_model_dtypes_follow_the_platform_and_keep_float32_params(platform, expected):
    kinds = dtypes(TINY, platform)
    assert kinds["param_dtype"] == jnp.float32
    assert kinds["dtype"] is None if expected is None else kinds["dtype"] == jnp.dtype(expected)
    # An explicit dtype is kept on every platform; stored configs with None are unchanged.
    assert dtypes(TINY.replace(compute={"dtype": "float32"}), platform)["dtype"] == jnp.float32
    assert TINY.compute.dtype is None


def test_cpu_default_is_unchanged():
    assert jax.default_backend() == "cpu"
    assert dtypes(TINY)["dtype"] is None
    model = create(TINY, rngs=nnx.Rngs(0))
    assert model.stack.layers[0].attention.query.dtype is None


def test_a_model_built_on_an_accelerator_computes_in_bfloat16(monkeypatch):
    """A model created where jax's default backend is "gpu" gets bfloat16 modules and float32
    parameters; it runs (here on CPU) and gives float32 logits close to float32 compute."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fast = create(TINY, rngs=nnx.Rngs(0))
    monkeypatch.undo()
    exact = create(TINY, rngs=nnx.Rngs(0))
    block = fast.stack.layers[0]
    assert block.attention.query.dtype == jnp.bfloat16 and block.mlp.up.dtype == jnp.bfloat16
    assert block.attention.query.kernel[...].dtype == jnp.float32
    ids = jnp.arange(16)[None] % 64
    assert fast.hidden_states(ids).dtype == jnp.bfloat16
    np.testing.assert_allclose(fast(ids), exact(ids), atol=0.1)
    assert not np.allclose(fast(ids), exact(ids), atol=1e-6)  # bfloat16 really was used


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, custom_vjp, scan...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _forward_jaxpr(config, implementation):
    model = create(config.replace(compute={"dtype": "bfloat16"},
                                  attention={"implementation": implementation}),
                   rngs=nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    ids = jnp.arange(16)[None] % config.vocab_size
    return jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(ids))(state).jaxpr


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
def test_bfloat16_attention_softmax_statistics_are_float32(implementation):
    eqns = list(_equations(_forward_jaxpr(TINY, implementation)))
    # The bfloat16 compute is real: the projections multiply bfloat16 operands.
    assert any(e.primitive.name == "dot_general"
               and e.invars[0].aval.dtype == jnp.bfloat16 for e in eqns)
    # Softmax: the row maximum and the exponentials (integer maxima of positions are not).
    statistics = {str(v.aval.dtype) for e in eqns if e.primitive.name in ("exp", "reduce_max")
                  for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    assert statistics == {"float32"}


def test_bfloat16_router_logits_and_probabilities_are_float32():
    eqns = list(_equations(_forward_jaxpr(TINY_MOE, "reference")))
    experts = TINY_MOE.moe.num_experts
    router = [e for e in eqns if e.primitive.name == "dot_general"
              and e.outvars[0].aval.shape[-1] == experts]
    assert router, "no router product found"
    for e in router:
        assert e.outvars[0].aval.dtype == jnp.float32
        assert {v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.float32)}
    exps = [e for e in eqns if e.primitive.name == "exp"]
    assert any(e.invars[0].aval.shape[-1] == experts for e in exps)  # the router softmax
    assert {str(e.invars[0].aval.dtype) for e in exps} == {"float32"}
