"""Inputs and measurements shared by the tests of the platform kernels (attention and MoE): a
kernel is checked by its outputs and gradients against the reference on the same inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfx.ops import dot_product_attention
from tfx.ops.moe import ExpertWeights


def attention_values_and_grads(implementation, query, key, value, cotangent, **kwargs):
    """dot_product_attention's output and its gradients w.r.t. (query, key, value) of
    sum(output * cotangent)."""
    def loss(q, k, v):
        out = dot_product_attention(q, k, v, implementation=implementation, **kwargs)
        return jnp.sum(out * cotangent), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)
    return out, grads


def expert_weights(key, experts, d_model, d_ff, gated=True) -> ExpertWeights:
    """Random experts [E, d_model, d_ff] / [E, d_ff, d_model], scaled to keep outputs O(1).

    key: a jax PRNG key, or a numpy Generator, which draws without compiling a sampler for each
    new shape (for tests that try many shapes)."""
    if isinstance(key, np.random.Generator):
        scale = np.float32(0.5 / np.sqrt(d_model))

        def normal(index, shape):
            return jnp.asarray(scale * key.standard_normal(shape, np.float32))
    else:
        keys, scale = jax.random.split(key, 3), 0.5 / np.sqrt(d_model)

        def normal(index, shape):
            return scale * jax.random.normal(keys[index], shape)
    return ExpertWeights(gate=normal(0, (experts, d_model, d_ff)) if gated else None,
                         up=normal(1, (experts, d_model, d_ff)),
                         down=normal(2, (experts, d_ff, d_model)))
