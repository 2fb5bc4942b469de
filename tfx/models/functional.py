"""A model as a pure function of its state, for `jax.jit`, `jax.grad`, `jax.vmap`...

`nnx.split` / `nnx.merge` alone are not enough for every model: dropout advances the RNG
counts stored in the module, and mixture-of-experts layers record their auxiliary losses (and
DeepSeek-style expert loads) in it. Inside `jax.jit(jax.grad(...))` those writes hit Variables
of an outer trace and NNX raises `TraceContextError`. `pure` keeps all of that inside one
call: the randomness comes from an explicit key, and what the layers record comes back as a
value.

The function is `pure` rather than `functional`: a package attribute named like one of its
modules is replaced by that module once the module is imported, which lazy exports
(`tfx._lazy`) cannot prevent.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.models.expert_losses import moe_losses
from tfx.nn.moe import MoE
from tfx.nn.paths import path_name

__all__ = ["pure"]

# The RNG streams a model draws from (dropout masks, router noise; `default` when the model was
# built from one seed), each reseeded from its own fold of the call's key.
_STREAMS = ("default", "dropout", "router")


def pure(model: nnx.Module, *,
         method: Callable | None = None) -> tuple[Callable, nnx.State, nnx.State]:
    """Split `model` into a pure `apply` and its state.

    >>> apply, params, rest = tfx.models.pure(model)
    >>> def loss(params, ids, rng):
    ...     logits, aux = apply(params, rest, ids, rng=rng)   # rng=None: evaluation mode
    ...     return cross_entropy(logits, ids) + 0.01 * aux["load_balancing_loss"]
    >>> grads = jax.jit(jax.grad(loss))(params, ids, jax.random.key(0))

    `apply(params, rest, *inputs, rng=None, **kwargs) -> (outputs, aux)` calls the model (or
    `method(model, *inputs, **kwargs)`) on a copy rebuilt from the state, in one of two modes:
    - `rng` a `jax.random.key`: training mode. Dropout and router noise draw from `rng` alone
      (the same key gives the same masks); mixture-of-experts layers record their losses.
    - `rng=None`: evaluation mode (`model.eval()`): no dropout, no router noise, nothing
      recorded (the losses and loads in aux are zeros).
    Models are *created in training mode*: called directly, a model with dropout drops out
    (drawing from the Rngs it was built with) until `model.eval()`; `model.train()` turns it
    back on. `apply` sets the mode of its copy only and never changes `model`, `params` or
    `rest`, so the same arguments always give the same result.

    aux holds "load_balancing_loss" and "router_z_loss" (float32 [], means over the MoE layers
    as `tfx.models.expert_losses`; zeros without experts) and "expert_load": {parameter path of
    each "deepseek" `selection_bias`: the load its layer saw, [num_experts] ([num_layers,
    num_experts] with scanned layers)}. A selection bias is an nnx.Param that no gradient
    moves: after the optimiser, replace it by `tfx.ops.moe.update_selection_bias(bias, load,
    rate)` of its old value, as tfx.train does.

    Args:
      model: any tfx model (or NNX module).
      method: what `apply` computes, `(model, *inputs, **kwargs) -> outputs`, e.g.
        `lambda m, ids: m.mlm_logits(m(ids))`; default: calling the model.
    Returns:
      (apply, params, rest): params, the model's nnx.Param state (what `jax.grad`
      differentiates and optax updates); rest, everything else but what layers record (the
      RNG streams' state), passed to `apply` as it is.
    """
    graphdef, params, recorded, rest = nnx.split(model, nnx.Param, nnx.Intermediate, ...)
    blank = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), recorded)
    call = method or (lambda module, *inputs, **kwargs: module(*inputs, **kwargs))

    def apply(params: nnx.State, rest: nnx.State, *inputs, rng: jax.Array | None = None,
              **kwargs):
        key = _key(rng)
        # Fresh Variables of the current trace: the call may update them (RNG counts, what
        # the layers record), which NNX allows only for Variables of the trace that runs it.
        rest = jax.tree.map(lambda x: x, rest)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), blank)
        module = nnx.merge(graphdef, params, zeros, rest)
        if key is None:
            module.eval()
        else:
            module.train()
            nnx.reseed(module, policy="match_shape",
                       **{name: jax.random.fold_in(key, i) for i, name in enumerate(_STREAMS)})
        outputs = call(module, *inputs, **kwargs)
        return outputs, {**moe_losses(module), "expert_load": _expert_loads(module)}

    return apply, params, rest


def _key(rng) -> jax.Array | None:
    """A typed jax key (a legacy uint32 [2] one is wrapped), or None."""
    if rng is None:
        return None
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and rng.ndim == 0:
        return rng
    if dtype == jnp.uint32 and rng.shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise TypeError(f"rng must be None (evaluation mode) or a jax.random.key, got "
                    f"{type(rng).__name__} {getattr(rng, 'shape', '')}")


def _expert_loads(module: nnx.Module) -> dict[str, jax.Array]:
    """{path of each selection bias: the expert load its layer recorded in this call}."""
    return {path_name((*path, "selection_bias")): layer.expert_load[...]
            for path, layer in nnx.iter_graph(module)
            if isinstance(layer, MoE) and layer.selection_bias is not None}
