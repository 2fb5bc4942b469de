"""Read a peft LoRA adapter folder (`adapter_config.json`, `adapter_model.safetensors`, as peft's
`save_pretrained` and `tfx.hf.peft_adapter.save_peft_adapter` write them) as the `LoRAWeights`
of a tfx model of its base (`tfx.hf.load`): the inverse of `save_peft_adapter`.

    model = tfx.hf.load("llama-folder")
    tfx.peft.lora.attach(model, load_peft_adapter("adapter-folder", model))

Layouts, as save_peft_adapter writes them the other way: peft's `lora_A.weight` [r, d_in] and
`lora_B.weight` [d_out, r] become a = Aᵀ [d_in, r] and b = Bᵀ [r, d_out]; an embedding's
`lora_embedding_A` [r, vocab], `lora_embedding_B` [d, r] become a [vocab, r], b [r, d]. Each
torch module name is read back through the family's tensor-name table
(`tfx.hf.peft_adapter.ARCHITECTURES`), so every family it exports loads. Stacked models
(scan_layers) get their layers stacked, a layer the adapter leaves out (peft's
layers_to_transform) zeros.

A fused torch module (Phi-3's qkv_proj, the hybrids' gated q_proj, Qwen3-Next's in_proj_qkvz,
ModernBERT's Wqkv, ...) holding k tfx linear layers has one LoRA, A [R, d_in], B [sum n_j, R]:
each part j gets a = Aᵀ and b_j = its columns of Bᵀ (unpacked by the family's own packing),
an exact LoRA of rank R, less the ranks whose row of b_j is zero. So the block-diagonal LoRA
of rank k·r that `save_peft_adapter` writes gives back each part's own rank-r factors, and a
part whose block is all zeros gets none.

Scales: peft's lora_alpha / r (alpha / sqrt(r) with use_rslora), r each module's own (its
factors' shape: rank_pattern) and lora_alpha its `alpha_pattern` entry if one matches (peft's
rule). `LoRAWeights` has one scale, the config's lora_alpha / r: a module whose scale differs
has the ratio folded into its b.

Refused (ValueError naming the module or setting): settings that make an adapter more than
LoRA factors (DoRA, trained biases, modules_to_save, fan_in_fan_out: GPT-2's Conv1D, ...);
LoRA on tied token embeddings (peft's leaves the tied head unchanged).
"""

from __future__ import annotations

import math
import pathlib
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.hf import io, tensorfiles
from tfx.hf.families import by_architecture
from tfx.hf.peft_adapter import ARCHITECTURES
from tfx.nn.embeddings import TokenEmbedding
from tfx.nn.paths import path_name
from tfx.peft.core import find_modules
from tfx.peft.lora import Factors, LoRAWeights

__all__ = ["load_peft_adapter"]

Path = tuple[str | int, ...]
_PREFIX = "base_model.model."
# Tensor name suffix -> (part, whether it is an embedding's; None: either). peft saves the base
# weight of an adapted embed_tokens or lm_head too (save_embedding_layers).
_SUFFIXES = {".lora_A.weight": ("A", False), ".lora_B.weight": ("B", False),
             ".lora_embedding_A": ("A", True), ".lora_embedding_B": ("B", True),
             ".base_layer.weight": ("base", None)}
# adapter_config.json settings that add more than LoRA factors; refused unless off.
_REFUSED = ("use_dora", "lora_bias", "bias", "modules_to_save", "fan_in_fan_out",
            "layer_replication", "target_parameters", "trainable_token_indices")


def load_peft_adapter(folder: str | pathlib.Path, model: nnx.Module, *,
                      architecture: str | None = None) -> LoRAWeights:
    """The LoRA factors of a peft adapter folder, laid out for `model`.

    Args:
      folder: holds `adapter_config.json` (peft_type "LORA") and `adapter_model.safetensors`.
      model: the tfx model of the adapter's base (`tfx.hf.load` of it), stacked or not; only
        its config and its layers' shapes are read.
      architecture: the transformers class of the base ("LlamaForCausalLM", ...); None: every
        architecture that can express `model`'s config and names the adapter's modules, which
        must all put them at the same places (Llama, Mistral and Qwen 2 name theirs alike).
    Returns:
      LoRAWeights for `tfx.peft.lora.attach(model, ...)` or `tfx.peft.attach_many`, in the
      dtype of the weights they adapt.
    Raises:
      ValueError: naming the file, tensor, module or setting at fault: a missing or malformed
        file; a setting above that is not off; a tensor that is no LoRA factor, or a factor
        without its pair; a module that the base architecture does not have (the adapter is
        for another model), shapes that do not fit the model; an architecture
        tfx cannot map or that cannot express the model.
      TypeError: folder is not a str or pathlib.Path.
    """
    if not isinstance(folder, str | pathlib.Path):
        raise TypeError(f"folder must be a str or pathlib.Path, got {type(folder).__name__}")
    folder = pathlib.Path(folder)
    config = _adapter_config(folder / "adapter_config.json")
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{file} is missing: a peft adapter folder holds its factors there")
    modules = _by_module(tensorfiles.header(file), file)
    architecture, targets = _targets(set(modules), model, architecture, folder)
    fused = ARCHITECTURES[architecture].modules(model.config).fused
    scale = _scale(config["lora_alpha"], config["r"], config["use_rslora"])
    layers = {path_name(p): m for p, m in find_modules(model, (nnx.Linear, TokenEmbedding))}
    factors = {}
    for module, parts in sorted(modules.items()):
        path, leaf = targets[module]
        if leaf == "fused":
            a, b = _fused_module(module, parts, [_layer(layers, p) for p in path], file)
        else:
            # Only the token embeddings are tied to the head (not Gemma 4's per-layer ones).
            tied = path == ("embeddings", "tokens") and model.config.embeddings.tie
            a, b = _factors(module, parts, leaf, _layer(layers, path), tied, file)
        alpha = _pattern(config["alpha_pattern"], module, config["lora_alpha"])
        ratio = _scale(alpha, a.shape[-1], config["use_rslora"]) / scale
        b = b if ratio == 1 else (b * ratio).astype(b.dtype)
        if leaf == "fused":
            factors |= _unfused(a, b, path, fused[module][1], [_layer(layers, p) for p in path])
        else:
            factors[path] = (a, b)
    if model.config.compute.scan_layers:
        factors = _stacked(factors, model.config.num_layers)
    return LoRAWeights({path_name(p): Factors(jnp.asarray(a), jnp.asarray(b))
                        for p, (a, b) in factors.items()}, scale)


def _adapter_config(path: pathlib.Path) -> dict:
    """adapter_config.json's LoRA settings (r, lora_alpha, use_rslora, alpha_pattern),
    checked; ValueError naming the file and the setting tfx cannot load."""
    config = io.read_json(path, dict, "a peft adapter folder describes its adapter there")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be \"LORA\", got {config.get('peft_type')!r}")
    for key in _REFUSED:
        if config.get(key) not in (None, False, "none", [], {}):
            raise ValueError(f"{path}: {key}={config[key]!r} is not supported (tfx loads "
                             "LoRA factors of linear layers and embeddings only)")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{path}: {key} must be a number > 0, got {value!r}")
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict) or not all(
            isinstance(v, int | float) and v > 0 for v in patterns.values()):
        raise ValueError(f"{path}: alpha_pattern must map module names to numbers > 0, got "
                         f"{patterns!r}")
    return {"r": config["r"], "lora_alpha": config["lora_alpha"], "alpha_pattern": patterns,
            "use_rslora": bool(config.get("use_rslora", False))}


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / (math.sqrt(rank) if rslora else rank)


def _pattern(patterns: dict, module: str, default: float) -> float:
    """peft's get_pattern_key: the first key that matches the end of the module's name."""
    return next((value for key, value in patterns.items()
                 if re.match(rf"(.*\.)?({key})$", module)), default)


def _by_module(entries: dict, file: pathlib.Path) -> dict[str, dict]:
    """Torch module name -> {"A", "B" (and an embedding's "base"): (tensor name, Entry),
    "embedding": whether peft stored it as an embedding's}."""
    modules: dict[str, dict] = {}
    for name, entry in entries.items():
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith(_PREFIX):
            raise ValueError(f"{file}: tensor {name!r} is no LoRA factor (expected "
                             f"{_PREFIX}<module>.lora_A.weight / lora_B.weight, or "
                             "lora_embedding_A / lora_embedding_B)")
        part, embedding = _SUFFIXES[suffix]
        parts = modules.setdefault(name[len(_PREFIX):-len(suffix)], {})
        parts[part] = (name, entry)
        if embedding is not None:
            parts["embedding"] = embedding
    for module, parts in modules.items():
        if "A" not in parts or "B" not in parts:
            names = sorted(v[0] for k, v in parts.items() if k != "embedding")
            raise ValueError(f"{file}: module {module} has only {names}; LoRA needs both its "
                             "A and B factors")
    return modules


def _targets(modules: set[str], model: nnx.Module, architecture: str | None,
             folder: pathlib.Path) -> tuple[str, dict[str, tuple]]:
    """An architecture whose table maps the adapter's modules (`architecture`, or every one
    that can express the model, which must all map them alike), and its map: torch module
    name -> (tfx module path per layer, "kernel" or "table"), or for a fused module (its parts'
    module paths, "fused")."""
    if architecture is not None and architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)} or None, got "
                         f"{architecture!r}")
    families, expressing = by_architecture(), []
    for name in [architecture] if architecture else sorted(ARCHITECTURES):
        try:
            _check_expresses(families[name], model.config, name)
            expressing.append(name)
        except ValueError as error:
            if architecture:
                raise ValueError(f"{folder}: the model is no {name}: {error}") from None
    if not expressing:
        raise ValueError(f"{folder}: no architecture of {sorted(ARCHITECTURES)} expresses the "
                         "model's config")
    found, errors = {}, []
    for name in expressing:
        try:
            found[name] = _mapped(modules, name, model.config, folder)
        except ValueError as error:
            errors.append(str(error))
    if not found:
        raise ValueError("; ".join(errors))
    if len({tuple(sorted(m.items(), key=str)) for m in found.values()}) > 1:
        raise ValueError(f"{folder}: architectures {sorted(found)} place the adapter's modules "
                         "differently; pass architecture= the base model's")
    return next(iter(found.items()))


def _check_expresses(family, config, architecture: str) -> None:
    """ValueError when `architecture` cannot express the model's config."""
    family.config_to_hf(config, architecture)
    if getattr(config, "moe", None) is not None and not getattr(family, "HAS_EXPERTS", False):
        raise ValueError(f"{architecture} cannot express a model with experts")


def _mapped(modules: set[str], architecture: str, config, folder) -> dict[str, tuple]:
    """The adapter's modules through one architecture's table (see `_targets`); ValueError
    naming the first module it does not have, or gives another meaning in peft."""
    export = ARCHITECTURES[architecture]
    table = export.modules(config)
    one = {name: (path, leaf) for path, (name, leaf) in table.one.items()}
    one |= {name: (parts, "fused") for name, (parts, _) in table.fused.items()}
    for module in sorted(modules):
        short = module.rpartition(".")[2]
        if module not in one:
            raise ValueError(f"{folder}: module {module} is not a {architecture} module that "
                             "LoRA can adapt (the adapter is for another model?); expected "
                             f"names such as {sorted({n.rpartition('.')[2] for n in one})}")
        if short in export.taken:
            raise ValueError(f"{folder}: on {architecture} peft reads {short} as the experts, "
                             f"not as {module}")
    return {module: one[module] for module in modules}


def _layer(layers: dict[str, nnx.Module], path: Path) -> nnx.Module:
    """The model's module at a per-layer path (its stacked module when layers are stacked)."""
    name = path_name(path)
    return layers[name] if name in layers else layers[path_name(io.split_layer(path)[0])]


def _factors(module: str, parts: dict, leaf: str, layer: nnx.Module, tied: bool,
             file: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """a [d_in, r], b [r, d_out] of one module, checked against the tfx layer it adapts
    (`tied`: token embeddings tied to the head, refused), in the dtype of its weight (float32
    for a quantized one)."""
    if parts["embedding"] != (leaf == "table"):
        kind = "an embedding" if leaf == "table" else "a linear layer"
        raise ValueError(f"{file}: {module} is {kind} but its factors are stored as "
                         f"{'an embedding' if parts['embedding'] else 'a linear layer'}'s")
    if tied:
        raise ValueError(f"{file}: LoRA on {module}, the tied token embeddings, cannot be "
                         "loaded: peft's embedding adapter leaves the tied head unchanged")
    a, b = (tensorfiles.read(parts[p][1], parts[p][0]).T for p in ("A", "B"))
    weight = (layer.table if leaf == "table" else layer.kernel)[...]
    d_in, d_out = ((layer.vocab_size, weight.shape[-1]) if leaf == "table"
                   else (layer.in_features, layer.out_features))
    r = a.shape[-1]
    if a.shape != (d_in, r) or b.shape != (r, d_out):
        raise ValueError(f"{file}: factors of {module} have shapes A {a.T.shape}, B {b.T.shape};"
                         f" the model's layer ({d_in} -> {d_out}) needs A [r, {d_in}], "
                         f"B [{d_out}, r]")
    if "base" in parts:
        _check_base(parts["base"], weight, leaf, module, file)
    dtype = _dtype(weight)
    return a.astype(dtype), b.astype(dtype)


def _fused_module(module: str, parts: dict, layers: list[nnx.Module], file: pathlib.Path
                  ) -> tuple[np.ndarray, np.ndarray]:
    """a [d_in, R], b [R, sum n_j] (the fused module's layout) of a fused module, checked
    against the tfx linear layers it packs."""
    if parts["embedding"]:
        raise ValueError(f"{file}: {module} is a linear layer but its factors are stored as "
                         "an embedding's")
    a, b = (tensorfiles.read(parts[p][1], parts[p][0]).T for p in ("A", "B"))
    d_in, d_out = layers[0].in_features, sum(layer.out_features for layer in layers)
    r = a.shape[-1]
    if a.shape != (d_in, r) or b.shape != (r, d_out):
        raise ValueError(f"{file}: factors of {module} have shapes A {a.T.shape}, B {b.T.shape};"
                         f" the model's layers it packs ({d_in} -> {d_out}) need A [r, {d_in}], "
                         f"B [{d_out}, r]")
    return a, b


def _unfused(a: np.ndarray, b: np.ndarray, paths: tuple[Path, ...], pack,
             layers: list[nnx.Module]) -> dict[Path, tuple[np.ndarray, np.ndarray]]:
    """Each part's factors of a fused module's LoRA a [d_in, R], b [R, sum n_j]: a, and its
    columns of b, without the ranks whose row there is zero (a part with no other gets none).
    `pack`: the family's packing of the parts' kernels (tfx.hf.peft_adapter), a permutation
    of columns, inverted here by packing the columns' own indices."""
    widths = [layer.out_features for layer in layers]
    starts = np.cumsum([0, *widths])
    order = pack([np.arange(start, start + n)[None]
                  for start, n in zip(starts[:-1], widths, strict=True)])[0]
    side_by_side = np.empty_like(b)
    side_by_side[:, order] = b  # packed column c is column order[c] of the parts side by side
    out = {}
    for path, layer, part in zip(paths, layers, np.split(side_by_side, starts[1:-1], axis=1),
                                 strict=True):
        used = np.any(part != 0, axis=1)
        if used.any():
            dtype = _dtype(layer.kernel[...])
            out[path] = (a[:, used].astype(dtype), part[used].astype(dtype))
    return out


def _dtype(weight) -> np.dtype:
    """Factors take the dtype of the weight they adapt (float32 for a quantized one)."""
    return weight.dtype if jnp.issubdtype(weight.dtype, jnp.floating) else np.dtype(np.float32)


def _check_base(part: tuple, weight, leaf: str, module: str, file: pathlib.Path) -> None:
    """A base weight saved beside the factors (torch's layout: an embedding's [vocab, d], a
    linear layer's [d_out, d_in]) must be the model's own."""
    saved = tensorfiles.read(part[1], part[0])
    saved = saved if leaf == "table" else saved.T
    if saved.shape != weight.shape or not np.array_equal(
            np.asarray(saved.astype(weight.dtype), np.float32), np.asarray(weight, np.float32)):
        raise ValueError(f"{file}: {module}'s base weight {saved.shape} differs from the "
                         "model's (resized or retrained?); tfx loads the LoRA factors onto the "
                         "model's own weights only")


def _stacked(factors: dict[Path, tuple], num_layers: int) -> dict[Path, tuple]:
    """Per-layer factors -> stacked [num_layers, ...] ones, padded with zeros to the largest
    rank of each module, and zeros for layers the adapter leaves out."""
    out, groups = {}, {}
    for path, pair in factors.items():
        kind, row = io.split_layer(path)
        if row is None:
            out[path] = pair
        else:
            groups.setdefault(kind, {})[row] = pair
    for kind, rows in groups.items():
        (d_in, _), (_, d_out) = (x.shape for x in next(iter(rows.values())))
        rank = max(a.shape[-1] for a, _ in rows.values())
        dtype = next(iter(rows.values()))[0].dtype
        a = np.zeros((num_layers, d_in, rank), dtype)
        b = np.zeros((num_layers, rank, d_out), dtype)
        for row, (fa, fb) in rows.items():
            a[row, :, :fa.shape[-1]], b[row, :fb.shape[0]] = fa, fb
        out[kind] = (a, b)
    return out
