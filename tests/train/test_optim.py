"""The optimiser's schedule and weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tfx.train.config import OptimConfig
from tfx.train.optim import learning_rate_schedule, make_optimizer


def test_warmup_then_cosine_to_the_floor():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    schedule = learning_rate_schedule(config, 110)
    assert schedule(0) == 0.0
    np.testing.assert_allclose(schedule(5), 0.5e-3, rtol=1e-6)
    np.testing.assert_allclose(schedule(10), 1e-3, rtol=1e-6)
    # Halfway through the decay the cosine is at the middle of [floor, peak].
    np.testing.assert_allclose(schedule(60), 1e-4 + 0.5 * (1e-3 - 1e-4), rtol=1e-5)
    np.testing.assert_allclose(schedule(110), 1e-4, rtol=1e-5)


def test_short_runs_cap_the_warmup():
    schedule = learning_rate_schedule(OptimConfig(warmup_steps=100), 5)
    assert float(schedule(4)) > 0.0


def test_weight_decay_touches_matrices_only():
    config = OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=None)
    optimizer = make_optimizer(config, 10)
    params = {"kernel": jnp.ones((3, 3)), "scale": jnp.ones((3,))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    np.testing.assert_allclose(updates["kernel"], -0.1 * 0.5 * params["kernel"], rtol=1e-6)
    np.testing.assert_array_equal(updates["scale"], 0.0)


def test_clipping_bounds_the_global_norm():
    config = OptimConfig(learning_rate=1.0, warmup_steps=0, grad_clip=1.0, weight_decay=0.0,
                         b1=0.9)
    optimizer = make_optimizer(config, 10)
    params = {"w": jnp.zeros((4,))}
    grads = {"w": jnp.full((4,), 100.0)}  # global norm 200
    _, state = optimizer.update(grads, optimizer.init(params), params)
    # Adam's first moment after one step is (1 - b1) x the gradient it was given: the clipped
    # one, of norm 1.
    mu = optax.tree_utils.tree_get(state, "mu")
    np.testing.assert_allclose(jnp.linalg.norm(mu["w"]), 0.1, rtol=1e-6)
    np.testing.assert_allclose(mu["w"], 0.1 * 0.5, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("learning_rate", 0.0), ("warmup_steps", -1),
                                         ("min_lr_ratio", 1.5), ("b2", 1.0),
                                         ("grad_clip", 0.0), ("weight_decay", -0.1)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OptimConfig(**{field: value})
