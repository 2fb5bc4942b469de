"""Many LoRA adapters in one batch (S-LoRA, Sheng et al. 2023; Punica, Chen et al. 2023): every
row of a batch uses its own adapter, or none, and gets the tokens that adapter alone gives.

    names = attach_many(model, {"sql": sql_weights, "chat": chat_weights})  # ("sql", "chat")
    @jax.jit
    def step(graphdef, state, ids, rows):   # rows int32 [batch]: 0 plain, 1 "sql", 2 "chat"
        model = nnx.merge(graphdef, state)
        with tfx.nn.row_variants(rows):
            return model(ids)

Each adapted linear layer becomes a `MultiLoRALinear` holding every adapter's factors stacked,
index 0 all zeros (no adapter); its forward gathers each row's a and b and adds
(x·a[row])·b[row] to x·W, never forming a·b. Adapters' scales are folded into their b and their
ranks padded with zeros to the largest, so adapters of any rank, alpha and targets mix; an
adapter that does not target a layer has zeros there.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.paths import path_name
from tfx.nn.variants import current_row_variants
from tfx.peft.core import PeftParam, extended_class, find_modules, set_module
from tfx.peft.lora import LoRAWeights
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear, _adopt

__all__ = ["MultiLoRALinear", "attach_many"]


class MultiLoRALinear(nnx.Linear):
    """An `nnx.Linear` plus, for each batch row, the low-rank update of the adapter that row
    chose with `tfx.nn.row_variants`: y[i] = x[i]·W + bias + (x[i]·a[rows[i]])·b[rows[i]].

    Args:
      base: the linear layer to adapt (its kernel [..., d_in, d_out] and bias stay).
      a: [..., n + 1, d_in, rank]; b: [..., n + 1, rank, d_out], the stacked factors of n
        adapters with the kernel's leading axes first (stacked layers), index 0 zeros, each
        adapter's scale already in its b.
    """

    def __init__(self, base: nnx.Linear, a: jax.Array, b: jax.Array):
        _adopt(self, base)
        self.lora_a, self.lora_b = PeftParam(a), PeftParam(b)

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        """[batch, ..., d_in] -> [batch, ..., d_out]; needs an active `tfx.nn.row_variants`
        with one row per batch row."""
        rows = current_row_variants()
        if rows is None:
            raise ValueError("this model serves several LoRA adapters (tfx.peft.multi_lora): "
                             "call it inside `with tfx.nn.row_variants(rows):`, rows int32 "
                             "[batch] naming each row's adapter (0 = none)")
        y = super().__call__(x, out_sharding=out_sharding)
        return y + _gathered_low_rank(x, rows, self.lora_a[...], self.lora_b[...], y.dtype)


def _gathered_low_rank(x: jax.Array, rows: jax.Array, a: jax.Array, b: jax.Array,
                      dtype) -> jax.Array:
    """Each row's own low-rank product (x[i]·a[rows[i]])·b[rows[i]], in `dtype`.

    Args:
      x: [batch, ..., d_in]; rows: int [batch] in [0, n); a: [n, d_in, rank];
        b: [n, rank, d_out].
    Returns:
      [batch, ..., d_out]. Under jit a row out of range gives NaN (jnp.take's fill), never
      another adapter's output; on concrete rows it is a ValueError.
    """
    if x.ndim < 2 or x.shape[0] != rows.shape[0]:
        raise ValueError(f"row_variants rows {rows.shape} must give one variant per batch row "
                         f"of the input {x.shape}")
    # Concrete rows (an eager call) are checked with numpy: jnp would trace inside nnx.scan.
    if not isinstance(rows, jax.core.Tracer) and not np.all(
            (np.asarray(rows) >= 0) & (np.asarray(rows) < len(a))):
        raise ValueError(f"row_variants rows must be in [0, {len(a)}) (0 = no adapter, i = the "
                         f"i-th adapter attached), got {np.asarray(rows).tolist()}")
    # Gathering the factors costs batch·(d_in + d_out)·rank, far less than a·b per row.
    h = jnp.einsum("b...i,bir->b...r", x.astype(dtype), jnp.take(a, rows, axis=0).astype(dtype))
    return jnp.einsum("b...r,bro->b...o", h, jnp.take(b, rows, axis=0).astype(dtype))


def attach_many(model: nnx.Module, adapters: Mapping[str, LoRAWeights]) -> tuple[str, ...]:
    """Replace (in place) every linear layer that any adapter targets by a `MultiLoRALinear`
    holding all the adapters' factors.

    Args:
      model: a plain model (no LoRA attached), layers stacked (scan_layers) or not.
      adapters: {name: LoRAWeights} (`tfx.peft.lora.init`/`weights_of`,
        `tfx.hf.load_peft_adapter`), each with factors laid out as the model's layers
        (stacked or not), on linear layers only; ranks, scales and targets may differ.
    Returns:
      the adapter names in index order: the i-th (from 0) is row variant i + 1; variant 0 is
      the plain model.
    Raises:
      TypeError: adapters is not a non-empty mapping of str names to LoRAWeights.
      ValueError: the model already has LoRA layers; a factor on a token embedding (not
        supported here) or on a path that is no linear layer of the model; factor shapes that
        do not fit the layer.
    """
    names = _checked_names(adapters)
    _check_plain(model)
    linears = {path_name(p): (p, m) for p, m in find_modules(model, nnx.Linear)}
    embeddings = {path_name(p) for p, _ in find_modules(model, TokenEmbedding)}
    for name in names:
        for path in adapters[name].factors:
            if path in embeddings:
                raise ValueError(f"adapter {name!r} has LoRA factors on the token embedding "
                                 f"{path}; attach_many serves LoRA on linear layers only")
            if path not in linears:
                raise ValueError(f"adapter {name!r} has LoRA factors for {path!r}, which is no "
                                 f"linear layer of this model; it has {sorted(linears)}")
    for path in sorted({p for name in names for p in adapters[name].factors}):
        graph_path, module = linears[path]
        a, b = _stacked_factors(path, module, [(n, adapters[n]) for n in names])
        set_module(model, graph_path, extended_class(MultiLoRALinear, type(module))(module, a, b))
    return names


def _checked_names(adapters) -> tuple[str, ...]:
    if not isinstance(adapters, Mapping) or not adapters:
        raise TypeError(f"adapters must be a non-empty mapping of names to LoRAWeights, got "
                        f"{adapters!r}")
    for name, weights in adapters.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"adapter names must be non-empty strings, got {name!r}")
        if not isinstance(weights, LoRAWeights):
            raise TypeError(f"adapter {name!r} must be tfx.peft.lora.LoRAWeights, got "
                            f"{type(weights).__name__}")
    return tuple(adapters)


def _check_plain(model: nnx.Module) -> None:
    adapted = find_modules(model, (LoRALinear, LoRAEmbedding, MultiLoRALinear))
    if adapted:
        raise ValueError(f"the model already has LoRA layers ({path_name(adapted[0][0])}, ...): "
                         "attach_many needs the plain model (tfx.peft.lora.detach first)")


def _stacked_factors(path: str, module: nnx.Linear, adapters: list[tuple[str, LoRAWeights]]
                     ) -> tuple[jax.Array, jax.Array]:
    """a [..., n + 1, d_in, r_max], b [..., n + 1, r_max, d_out] of one layer: zeros at 0 and
    for adapters without factors there, each adapter's scale folded into its b."""
    lead, d_in, d_out = module.kernel.shape[:-2], module.in_features, module.out_features
    kernel_dtype = module.kernel[...].dtype
    # Float weights give the factors their dtype; quantized (integer) ones get float32.
    dtype = kernel_dtype if jnp.issubdtype(kernel_dtype, jnp.floating) else np.float32
    present = [(i, name, w.factors[path], w.scale)
               for i, (name, w) in enumerate(adapters, 1) if path in w.factors]
    rank = max(f.a.shape[-1] for _, _, f, _ in present)
    a = np.zeros((*lead, len(adapters) + 1, d_in, rank), dtype)
    b = np.zeros((*lead, len(adapters) + 1, rank, d_out), dtype)
    for i, name, f, scale in present:
        r = f.a.shape[-1]
        if f.a.shape != (*lead, d_in, r) or f.b.shape != (*lead, r, d_out):
            raise ValueError(f"adapter {name!r}: factors of {path} have shapes a {f.a.shape}, "
                             f"b {f.b.shape}; the layer needs a {(*lead, d_in, r)}, "
                             f"b {(*lead, r, d_out)}")
        a[..., i, :, :r] = np.asarray(f.a, np.float32)
        b[..., i, :r, :] = np.asarray(f.b, np.float32) * scale
    return jnp.asarray(a), jnp.asarray(b)
