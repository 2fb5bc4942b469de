"""LoRA (Hu et al. 2021): W + scale·a·b on chosen weights, as transforms of a model's state.

The factors are their own pytree, `LoRAWeights` ({module path: Factors(a, b)} and the scale):

    weights = lora.init(rng, nnx.state(model, nnx.Param), rank=8, alpha=16,
                        targets=("query", "value"))
    lora.attach(model, weights)        # forward: x·W + scale·(x·a)·b, a·b never formed
    ...train nnx.split(model, PeftParam, ...)...
    weights = lora.detach(model)       # the plain model back, and the trained factors
    merged = lora.merge(nnx.state(model, nnx.Param), weights)     # W + scale·a·b, for serving
    lora.unmerge(merged, weights)      # W again (within float rounding)

`LoRA(rank=..., ...).attach(model, rngs=...)` does init + attach in one call, as every method
in `tfx.peft` does. Targets are `nnx.Linear` layers (attention and MLP projections, heads) and
token embeddings, named as peft's `target_modules` are (see `tfx.peft.core.path_matcher`). A
subclass of either (a quantized layer of `tfx.quant`: QLoRA) keeps its own forward under the
factors, and a frozen weight of another variable kind than `nnx.Param` is adapted as well.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.paths import path_name
from tfx.ops._pytree import static_field
from tfx.peft.core import extended_class, find_modules, path_matcher, retract, set_module
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear
from tfx.peft.settings import LoRASettings

__all__ = ["Factors", "LoRA", "LoRAWeights", "attach", "detach", "init", "merge", "unmerge",
           "weights_of"]

_WEIGHT_NAMES = ("kernel", "table")  # of linear layers and of embeddings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Factors:
    """One adapted weight's factors: a [..., d_in, rank], b [..., rank, d_out] (an embedding's
    d_in is its vocabulary); leading axes as the weight's (stacked layers)."""

    a: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """factors: {module path ("stack/layers/0/attention/query"): Factors}; scale: static."""

    factors: dict[str, Factors]
    scale: float = static_field()


class LoRA(LoRASettings):
    """LoRA: its settings (`tfx.peft.settings.LoRASettings`) and how it attaches."""

    def attach(self, model: nnx.Module, *, rngs: nnx.Rngs) -> nnx.Module:
        """Add freshly initialised factors to `model`'s targets, in place; returns the model."""
        # Every variable kind: a frozen base need not be an nnx.Param (tfx.quant's are not).
        weights = init(rngs.params(), nnx.state(model), rank=self.rank,
                       alpha=self.alpha, targets=self.targets, init_style=self.init_style,
                       init_scale=self.init_scale, rslora=self.rslora)
        return attach(model, weights, dropout=self.dropout, rngs=rngs)


def init(rng: jax.Array, state: nnx.State, *, rank: int, alpha: float,
         targets: str | tuple[str, ...], init_style: str = "peft", init_scale: float = 0.05,
         rslora: bool = False) -> LoRAWeights:
    """Factors for every weight of `state` (a model's `nnx.Param` state, or its whole state)
    whose module path matches `targets`: `kernel` [..., d_in, d_out] of linear layers and
    `table` [vocab, d] of embeddings. ΔW = scale·a·b is zero at init in every style. Factors
    take the weight's dtype; a weight stored as integers (quantized) gets float32 factors.

    Raises ValueError for targets that match nothing (listing what can be adapted) and for a
    rank outside [1, min(d_in, d_out)] of a target.
    """
    LoRASettings(rank=rank, alpha=alpha, targets=targets, init_style=init_style,
                 init_scale=init_scale)  # checks them
    matches = path_matcher(targets)
    weights = _adaptable(state)
    chosen = {path: w for path, w in weights.items() if matches(path)}
    if not chosen:
        raise ValueError(f"LoRA targets {targets!r} match no module; adaptable modules: "
                         f"{sorted(weights)}")
    factors = {}
    for index, (path, (kind, weight)) in enumerate(sorted(chosen.items())):
        *lead, d_in, d_out = weight.shape
        if not 1 <= rank <= min(d_in, d_out):
            raise ValueError(f"rank must be in [1, min(d_in, d_out)] = [1, {min(d_in, d_out)}] "
                             f"for {path} ({d_in} -> {d_out}), got {rank}")
        key = jax.random.fold_in(rng, index)
        a_shape, b_shape = (*lead, d_in, rank), (*lead, rank, d_out)
        if kind == "table" and init_style == "peft":  # peft zeroes the embedding's A instead
            a = jnp.zeros(a_shape, jnp.float32)
            b = jax.random.normal(key, b_shape, jnp.float32)
        else:
            b = jnp.zeros(b_shape, jnp.float32)
            if init_style == "peft":
                bound = 1.0 / math.sqrt(d_in)
                a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
            elif init_style == "seed":
                bound = init_scale / math.sqrt(rank)
                a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
            else:
                a = init_scale * jax.random.normal(key, a_shape, jnp.float32)
        dtype = weight.dtype if jnp.issubdtype(weight.dtype, jnp.floating) else jnp.float32
        factors[path] = Factors(a.astype(dtype), b.astype(dtype))
    return LoRAWeights(factors, alpha / (math.sqrt(rank) if rslora else rank))


def attach(model: nnx.Module, weights: LoRAWeights, *, dropout: float = 0.0,
           rngs: nnx.Rngs | None = None) -> nnx.Module:
    """Replace each targeted layer of `model` by its LoRA form holding `weights`' factors as
    `PeftParam`s (in place; the frozen weights keep their paths). Returns the model. The LoRA
    form of a subclass of `nnx.Linear` / `TokenEmbedding` derives from that subclass too, so
    its own forward (e.g. a quantized kernel's) runs under the low-rank update."""
    modules = dict((path_name(p), (p, m)) for p, m in
                   find_modules(model, (nnx.Linear, TokenEmbedding)))
    for path, factors in weights.factors.items():
        if path not in modules:
            raise ValueError(f"LoRA factors for {path!r}, which is not a linear layer or "
                             f"embedding of this model; it has {sorted(modules)}")
        graph_path, module = modules[path]
        if isinstance(module, LoRALinear | LoRAEmbedding):
            raise ValueError(f"{path} already has LoRA factors; detach them first")
        base = module.kernel if isinstance(module, nnx.Linear) else module.table
        for name, factor, want in (("a", factors.a, (*base.shape[:-1], factors.a.shape[-1])),
                                   ("b", factors.b, (*base.shape[:-2], factors.b.shape[-2],
                                                     base.shape[-1]))):
            if factor.shape != want:
                raise ValueError(f"factor {name} of {path} has shape {factor.shape}; the "
                                 f"weight {base.shape} needs {want}")
        if isinstance(module, nnx.Linear):
            if dropout and base.ndim > 2:
                raise ValueError("LoRA dropout needs unstacked layers (compute.scan_layers=False)")
            new = extended_class(LoRALinear, type(module))(
                module, factors.a, factors.b, scale=weights.scale, dropout=dropout, rngs=rngs)
        else:
            new = extended_class(LoRAEmbedding, type(module))(module, factors.a, factors.b,
                                                              scale=weights.scale)
        set_module(model, graph_path, new)
    return model


def weights_of(model: nnx.Module) -> LoRAWeights:
    """The factors a model carries (after `attach` and training)."""
    adapted = find_modules(model, (LoRALinear, LoRAEmbedding))
    if not adapted:
        raise ValueError("the model has no LoRA factors (call attach first)")
    scales = {m.scale for _, m in adapted}
    if len(scales) > 1:
        raise ValueError(f"the model's LoRA layers have different scales {sorted(scales)}")
    return LoRAWeights({path_name(p): Factors(m.lora_a[...], m.lora_b[...])
                        for p, m in adapted}, scales.pop())


def detach(model: nnx.Module) -> LoRAWeights:
    """Put the plain layers back (in place) and return the factors they carried."""
    weights = weights_of(model)
    for path, module in find_modules(model, (LoRALinear, LoRAEmbedding)):
        set_module(model, path, _plain(module))
    return weights


def merge(state: nnx.State, weights: LoRAWeights) -> nnx.State:
    """W + scale·a·b at every adapted weight of `state` (a plain model's Param state)."""
    return _shifted(state, weights, 1.0)


def unmerge(state: nnx.State, weights: LoRAWeights) -> nnx.State:
    """W - scale·a·b: undoes `merge` (exactly up to float rounding, about 1 ulp of W)."""
    return _shifted(state, weights, -1.0)


def _shifted(state, weights: LoRAWeights, sign: float):
    found = set()

    def shift(path, value):
        module, _, leaf = path_name(path).rpartition("/")
        if leaf not in _WEIGHT_NAMES or module not in weights.factors:
            return value
        found.add(module)
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"cannot merge LoRA factors into {module}, stored as {value.dtype} "
                             "(quantized): keep the factors attached instead")
        f = weights.factors[module]
        delta = jnp.matmul(f.a.astype(jnp.float32), f.b.astype(jnp.float32))
        return (value.astype(jnp.float32) + sign * weights.scale * delta).astype(value.dtype)

    out = jax.tree.map_with_path(shift, state)
    missing = sorted(set(weights.factors) - found)
    if missing:
        raise ValueError(f"the state has no weight for LoRA factors of {missing}")
    return out


def _adaptable(state: nnx.State) -> dict[str, tuple[str, jax.Array]]:
    """{module path: (weight name, weight)} of every linear kernel and embedding table."""
    out = {}
    for path, value in jax.tree.leaves_with_path(state):
        module, _, leaf = path_name(path).rpartition("/")
        if leaf in _WEIGHT_NAMES and value.ndim >= 2:
            out[module] = (leaf, value)
    return out


def _plain(module: LoRALinear | LoRAEmbedding) -> nnx.Linear | TokenEmbedding:
    """The layer `module` adapted, in place: its class (nnx.Linear, TokenEmbedding or the
    subclass the LoRA form derived from) and its weight Variables, no factors."""
    for name in ("lora_a", "lora_b", "scale", "lora_dropout"):
        if hasattr(module, name):
            delattr(module, name)
    return retract(module, LoRALinear if isinstance(module, LoRALinear) else LoRAEmbedding)
