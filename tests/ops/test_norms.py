"""tfx.ops.norms: layer_norm and rms_norm against the formula in float64, without parameters
too, and their errors (the modules of tfx.nn.norms are tested in tests/nn/test_norms.py)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from tfx.ops.norms import layer_norm, rms_norm


def test_without_parameters_equals_the_formula():
    x = np.random.default_rng(0).standard_normal((3, 2, 7)) * 4 + 2
    centred = x - x.mean(-1, keepdims=True)
    chex.assert_trees_all_close(layer_norm(jnp.float32(x), epsilon=1e-5),
                                centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 1e-5),
                                atol=1e-5)
    chex.assert_trees_all_close(rms_norm(jnp.float32(x), epsilon=1e-6),
                                x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6), atol=1e-5)


def test_bfloat16_input_gives_bfloat16_and_statistics_in_float32():
    x = jnp.asarray([[1000.0, 1004.0, 1008.0, 1012.0]], jnp.bfloat16)  # exact in bfloat16
    out = layer_norm(x, epsilon=1e-5)
    chex.assert_type(out, jnp.bfloat16)
    # variance 20 = E[x²] - E[x]² with E[x²] near 1e6: bfloat16 spaces numbers there 4096
    # apart, float32 1/16
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                jnp.asarray([[-1.342, -0.447, 0.447, 1.342]]), atol=1e-2)


@pytest.mark.parametrize("call, error, match", [
    (lambda x: layer_norm(x.astype(jnp.int32), epsilon=1e-5), TypeError, "x must have a floating"),
    (lambda x: rms_norm(x, epsilon=0.0), ValueError, "epsilon must be > 0"),
    (lambda x: layer_norm(x, jnp.ones(4), epsilon=1e-5), ValueError,
     r"scale must be \[features\] = \[3\]"),
    (lambda x: layer_norm(x, jnp.ones(3), jnp.ones((1, 3)), epsilon=1e-5), ValueError,
     r"bias must be \[features\] = \[3\]"),
])
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(jnp.ones((2, 3), jnp.float32))
