"""Prefix tuning (Li & Liang 2021): learned keys and values that every query of a targeted
attention layer sees before the real tokens.

`attach` extends each targeted `tfx.nn.Attention` with `Prefixed` in place (the
same module object, its class swapped, so weights keep their paths and layers stacked for
nnx.scan stay one module), whose `attended` step puts the prefix before the keys the cache
gives (after RoPE and after the KV cache is written): caches hold real tokens only, and
`model.init_cache` and `tfx.generate` work unchanged. Queries and the output length are
unchanged. `detach` swaps the class back and drops the prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn.attention import Attention, Keys
from tfx.nn.paths import path_name
from tfx.ops.attention import static_spec
from tfx.ops.leading_keys import prepend_keys
from tfx.peft.core import PeftParam, extend, find_modules, path_matcher, retract
from tfx.peft.settings import PrefixSettings

__all__ = ["EncodedPrefix", "Prefix", "PrefixEncoder", "PrefixKV", "Prefixed"]


class PrefixKV(nnx.Module):
    """One attention layer's learned prefix: key and value [num_tokens, num_kv_heads, head_dim]
    (with a leading [num_layers] axis on models that stack their layers)."""

    def __init__(self, key: jax.Array, value: jax.Array):
        self.key, self.value = PeftParam(key), PeftParam(value)

    def __call__(self) -> tuple[jax.Array, jax.Array]:
        return self.key[...], self.value[...]


class PrefixEncoder(nnx.Module):
    """peft's reparameterisation, shared by every targeted layer: an embedding
    [num_tokens, d_model] -> Linear(d_model, projection) -> tanh -> Linear(projection,
    num_layers * 2 * num_kv_heads * head_dim). Training the MLP rather than the prefix directly
    is what Li & Liang found stable."""

    def __init__(self, num_tokens: int, d_model: int, projection: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, *, init_std: float, rngs: nnx.Rngs):
        self.kv_shape = (num_layers, 2, num_kv_heads, head_dim)
        out = num_layers * 2 * num_kv_heads * head_dim

        def normal(*shape, std):
            return PeftParam(std * jax.random.normal(rngs.params(), shape, jnp.float32))

        self.embedding = normal(num_tokens, d_model, std=init_std)
        self.hidden_kernel = normal(d_model, projection, std=d_model**-0.5)
        self.hidden_bias = PeftParam(jnp.zeros((projection,), jnp.float32))
        self.out_kernel = normal(projection, out, std=projection**-0.5)
        self.out_bias = PeftParam(jnp.zeros((out,), jnp.float32))

    def __call__(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s key and value, each [num_tokens, num_kv_heads, head_dim]. Only that
        layer's columns of the output projection are computed."""
        hidden = jnp.tanh(self.embedding[...] @ self.hidden_kernel[...] + self.hidden_bias[...])
        kernel = self.out_kernel[...].reshape(hidden.shape[1], *self.kv_shape)[:, layer]
        bias = self.out_bias[...].reshape(self.kv_shape)[layer]
        kv = jnp.einsum("gp,pckd->cgkd", hidden, kernel) + bias[:, None]
        return kv[0], kv[1]


class EncodedPrefix(nnx.Module):
    """A layer's view of the shared `PrefixEncoder` (the same module object in every layer)."""

    def __init__(self, encoder: PrefixEncoder, layer: int):
        self.encoder, self.layer = encoder, layer

    def __call__(self) -> tuple[jax.Array, jax.Array]:
        return self.encoder(self.layer)


class Prefixed(Attention):
    """An extension (`tfx.peft.core.extend`): a `tfx.nn.Attention` whose queries also see
    `prefix()`: learned keys and values [num_prefix, num_kv_heads, head_dim] each, before the
    real keys, with mask True and bias 0 (ALiBi, T5 and Transformer-XL terms cover the real
    keys only). Made by `prefixed`."""

    def attended(self, keys: Keys) -> Keys:
        spec = None if keys.heads_major else static_spec(keys.is_causal, keys.sparsity)
        key, value, mask, bias, sparsity = prepend_keys(
            self.prefix(), keys.key, keys.value, heads_major=keys.heads_major, mask=keys.mask,
            bias=keys.bias, spec=spec, query_segment_ids=keys.query_segment_ids,
            key_segment_ids=keys.key_segment_ids)
        return dataclasses.replace(
            keys, key=key, value=value, positions=None, mask=mask, bias=bias, is_causal=False,
            sparsity=sparsity, query_segment_ids=None, key_segment_ids=None)


def prefixed(attention: Attention, prefix: PrefixKV | EncodedPrefix) -> Attention:
    """Extend `attention` (in place) with `Prefixed`, holding `prefix`; returns it."""
    extend(attention, Prefixed).prefix = prefix
    return attention


def detach(model: nnx.Module) -> nnx.Module:
    """Remove every prefix from `model` (in place): its attentions become plain again."""
    for _, attention in find_modules(model, Prefixed):
        del attention.prefix
        retract(attention, Prefixed)
    return model


class Prefix(PrefixSettings):
    """Prefix tuning: its settings (`tfx.peft.settings.PrefixSettings`) and how it attaches;
    `Prefix.fold(model)` replaces a trained reparameterisation MLP by its output."""

    def attach(self, model: nnx.Module, *, rngs: nnx.Rngs) -> nnx.Module:
        """Give every targeted attention of `model` a prefix (in place) and return `model`.

        The new parameters are `PeftParam`s at "<attention path>/prefix/..."; existing weights
        keep their paths. Raises ValueError when the model has no `tfx.nn.Attention`, when the
        targets match none (listing those available), or when a target already has a prefix.
        """
        targets = _targets(model, self.targets)
        if self.projection == 0:
            for _, attention in targets:
                prefixed(attention, self._direct(attention, rngs))
            return model
        stacked = [path_name(path) for path, attention in targets if _num_stacked(attention)]
        if stacked:
            raise ValueError(
                f"projection > 0 shares one MLP across layers, which scanned layers "
                f"(compute.scan_layers=True) cannot hold: {stacked}; use projection=0 or "
                "compute.scan_layers=False")
        head_shapes = {(a.num_kv_heads, a.head_dim, a.d_model) for _, a in targets}
        if len(head_shapes) > 1:
            raise ValueError(f"projection > 0 needs targets of one (num_kv_heads, head_dim, "
                             f"d_model), got {sorted(head_shapes)}")
        num_kv_heads, head_dim, d_model = head_shapes.pop()
        encoder = PrefixEncoder(self.num_tokens, d_model, self.projection, len(targets),
                                num_kv_heads, head_dim, init_std=self.init_std, rngs=rngs)
        for layer, (_, attention) in enumerate(targets):
            prefixed(attention, EncodedPrefix(encoder, layer))
        return model

    @staticmethod
    def fold(model: nnx.Module) -> nnx.Module:
        """For inference: replace each layer's `EncodedPrefix` by a `PrefixKV` holding its
        output (in place; the MLP is dropped). A model without one is returned unchanged."""
        for _, attention in find_modules(model, Prefixed):
            if isinstance(attention.prefix, EncodedPrefix):
                attention.prefix = PrefixKV(*attention.prefix())
        return model

    def _direct(self, attention: Attention, rngs: nnx.Rngs) -> PrefixKV:
        count = _num_stacked(attention)
        shape = (self.num_tokens, attention.num_kv_heads, attention.head_dim)
        shape = shape if count is None else (count, *shape)

        def normal():
            return self.init_std * jax.random.normal(rngs.params(), shape, jnp.float32)

        return PrefixKV(normal(), normal())


def _targets(model: nnx.Module, targets: str | Iterable[str]) -> list[tuple[tuple, Attention]]:
    available = find_modules(model, Attention)
    if not available:
        raise ValueError(f"{type(model).__name__} has no tfx.nn.Attention modules to prefix")
    matches = path_matcher(targets)
    chosen = [(path, a) for path, a in available if matches(path_name(path))]
    if not chosen:
        names = [path_name(path) for path, _ in available]
        raise ValueError(f"targets {targets!r} match no attention module; available: {names}")
    taken = [path_name(path) for path, a in chosen if isinstance(a, Prefixed)]
    if taken:
        raise ValueError(f"attention modules already have a prefix: {taken}")
    return chosen


def _num_stacked(attention: Attention) -> int | None:
    """num_layers when the attention's weights are stacked for nnx.scan ([num_layers, in, out]
    kernels), else None."""
    kernel = attention.query.kernel
    return kernel.shape[0] if kernel.ndim == 3 else None
