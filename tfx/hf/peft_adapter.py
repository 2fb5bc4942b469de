"""Export a tfx model's LoRA factors as a peft adapter folder (`adapter_model.safetensors`,
`adapter_config.json`, as peft's `save_pretrained` writes them): `peft.PeftModel.from_pretrained`
then puts the same adapter on the transformers model that `tfx.hf.save` writes (or that the
model was loaded from).

Layouts. tfx's factors a [d_in, r], b [r, d_out] (ΔW = scale·a·b on a kernel [d_in, d_out])
become peft's `lora_A.weight` [r, d_in], `lora_B.weight` [d_out, r] (ΔW = scale·B·A on a torch
weight [d_out, d_in]); an embedding's a [vocab, r], b [r, d] become `lora_embedding_A`
[r, vocab], `lora_embedding_B` [d, r]. Stacked layers (scan_layers) are written one by one.

Each factor's torch module is read off its family's tensor-name table (`ARCHITECTURES`), named
as in memory, where peft finds it (GPT-NeoX's head is `lm_head` there, `embed_out` on disk).
Fused modules (Phi-3's `qkv_proj`, `gate_up_proj`; GPT-NeoX's `query_key_value`; GPT-2's
Conv1D `c_attn`; ModernBERT's `Wqkv`, `Wi`; Qwen3-Next's `in_proj_qkvz`, `in_proj_ba` (per key
head) and Qwen3.5's `in_proj_qkv`; both families' gated `q_proj`, per head [query | gate]) get
one exact LoRA of rank k·r from their k adapted parts (a_j [d_in, r], b_j [r, n_j]):
A = [a_1 … a_k] and B = the b_j on a block diagonal laid out by the family's own packing (zero
rows for parts without factors), so A·B = the a_j·b_j side by side.
`rank_pattern` gives such a module its rank and `alpha_pattern` lora_alpha = scale·k·r: every
module keeps tfx's one scale.

Refused (ValueError naming the module): weights that are not a whole torch linear layer or
embedding (routers, GPT-OSS's included: transformers 5 fuses them and the experts); on Qwen 3
MoE, Qwen3-Next and DeepSeek-V3 the dense MLPs and shared experts (peft, for transformers 5,
reads any target named gate_proj / up_proj / down_proj there as the fused experts); LoRA on
tied token embeddings; several ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np
from flax import nnx

from tfx.hf import (
    bert,
    deepseek,
    gemma,
    gemma4,
    gpt2,
    gpt_neox,
    gpt_oss,
    io,
    llama,
    modernbert,
    olmo2,
    olmo3,
    phi3,
    qwen3_next,
    smollm3,
)
from tfx.hf.families import by_architecture
from tfx.nn.paths import path_name
from tfx.peft.core import find_modules
from tfx.peft.lora import weights_of
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear

__all__ = ["ARCHITECTURES", "save_peft_adapter"]

Path = tuple[str | int, ...]
# A family's packing of the kernels [d_in, n_j] of a fused module's parts into its kernel
# [d_in, sum n_j] (nnx layout).
Pack = Callable[[list[np.ndarray]], np.ndarray]
_WEIGHTS = ("kernel", "table")  # the leaf names of what LoRA adapts (linear, embedding)


@dataclasses.dataclass(frozen=True)
class _Modules:
    """The torch modules of one model that LoRA factors can go to.

    one: tfx module path (per layer) -> (HF module name, "kernel" or "table").
    fused: HF module name -> (the tfx linear layers it packs (module paths, in order), the
      family's `Pack` of their kernels into its kernel).
    """

    one: dict[Path, tuple[str, str]]
    fused: dict[str, tuple[tuple[Path, ...], Pack]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Export:
    """An architecture's `_Modules` (a function of the config), peft task type, whether its
    linear layers are Conv1D ([in, out] weights: peft's fan_in_fan_out), and the module names
    that peft reads as something else on it (`_MOE_NAMES`)."""

    modules: Callable[..., _Modules]
    task_type: str = "CAUSAL_LM"
    fan_in_fan_out: bool = False
    taken: tuple[str, ...] = ()


def _one_to_one(tensor_names: Callable) -> Callable[..., _Modules]:
    """The `_Modules` of a family whose adaptable weights each are one torch module."""
    return lambda config: _Modules(_modules(tensor_names(config)))


def _side_by_side(kernels: list[np.ndarray]) -> np.ndarray:
    # Phi-3's fused rows and GPT-2's Conv1D columns both put the parts' outputs one after another.
    return np.concatenate(kernels, axis=-1)


def _phi3(config) -> _Modules:
    fused = {name: paths for name, (paths, _) in phi3.fused_tensors(config).items()}
    return _Modules(_modules(phi3.tensor_names(config)), _fused(fused, _side_by_side))


def _gpt_neox(config) -> _Modules:
    def pack(kernels):  # query_key_value interleaves the parts head by head
        return gpt_neox.pack_heads(kernels, config.num_heads).T

    # peft names modules as they are in memory, where transformers 5 calls embed_out lm_head.
    return _Modules(_modules(gpt_neox.tensor_names(config, "lm_head.weight")),
                    _fused(gpt_neox.packed_tensors(config), pack))


def _gpt2(config) -> _Modules:
    return _Modules(_modules(gpt2.tensor_names(config)),
                    _fused(gpt2.packed_tensors(config), _side_by_side))


def _bert(config) -> _Modules:
    # BertModel has the encoder and the pooler, not the masked-LM head.
    groups = bert.tensor_table(config)
    return _Modules(_modules({path: name for group in ("encoder", "pooler")
                              for name, path, _ in groups[group]}))


def _modernbert(config) -> _Modules:
    # ModernBertModel is the encoder alone (no `model.` prefix, no masked-LM head).
    fused = {name: paths for name, (paths, _) in modernbert.fused_tensors(config).items()}
    return _Modules(_modules({path: name for name, path, _ in
                              modernbert.tensor_table(config)["encoder"]}),
                    _fused(fused, _side_by_side))


def _gpt_oss(config) -> _Modules:
    # Its router is no torch linear layer (transformers' GptOssTopKRouter): not adaptable.
    names = {path: name for path, name in gpt_oss.tensor_names(config).items()
             if "router" not in path}
    return _Modules(_modules(names))


def _hybrid(fused: bool) -> Callable[..., _Modules]:
    """The `_Modules` of Qwen3-Next (`fused` Gated DeltaNet projections) or Qwen3.5: the
    converter's packings of q_proj and of the input projections, as merges into torch weights
    [sum n_j, d_in] (hence the transpose)."""
    def modules(config) -> _Modules:
        packed = qwen3_next.packed_kernels(config, fused=fused)
        return _Modules(_modules(qwen3_next.tensor_names(config)), {
            name.removesuffix(".weight"): (tuple(path[:-1] for path in paths),
                                           lambda kernels, merge=merge: merge(*kernels).T)
            for name, (paths, merge) in packed.items()})
    return modules


# peft (for transformers 5) rewrites every target named so on a Qwen 3 MoE or DeepSeek-V3 model
# (and Qwen3-Next, whose conversion is Qwen 2 MoE's as well) into the fused experts
# (gate_up_proj, down_proj), so the dense MLPs and shared experts, whose
# modules have these names too, cannot be targeted: their factors are refused.
_MOE_NAMES = ("gate_proj", "up_proj", "down_proj")
ARCHITECTURES: dict[str, _Export] = {
    **dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                     "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
                    _Export(_one_to_one(llama.tensor_names))),
    "Qwen3MoeForCausalLM": _Export(_one_to_one(llama.tensor_names), taken=_MOE_NAMES),
    **dict.fromkeys(("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                    _Export(_one_to_one(gemma.tensor_names))),
    "Olmo2ForCausalLM": _Export(_one_to_one(olmo2.tensor_names)),
    "Olmo3ForCausalLM": _Export(_one_to_one(olmo3.tensor_names)),
    "SmolLM3ForCausalLM": _Export(_one_to_one(smollm3.tensor_names)),
    # The layers that share another's keys have no k_proj / v_proj (gemma4.tensor_names).
    "Gemma4ForCausalLM": _Export(_one_to_one(gemma4.tensor_names)),
    "GptOssForCausalLM": _Export(_gpt_oss),
    "Qwen3NextForCausalLM": _Export(_hybrid(fused=True), taken=_MOE_NAMES),
    **dict.fromkeys(("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"), _Export(_hybrid(False))),
    "ModernBertModel": _Export(_modernbert, task_type="FEATURE_EXTRACTION"),
    "DeepseekV3ForCausalLM": _Export(_one_to_one(deepseek.tensor_names), taken=_MOE_NAMES),
    "Phi3ForCausalLM": _Export(_phi3),
    "GPTNeoXForCausalLM": _Export(_gpt_neox),
    "GPT2LMHeadModel": _Export(_gpt2, fan_in_fan_out=True),
    "BertModel": _Export(_bert, task_type="FEATURE_EXTRACTION"),
}


def save_peft_adapter(model: nnx.Module, directory: str | pathlib.Path, *, architecture: str,
                      base_model: str | None = None) -> None:
    """Write `model`'s LoRA factors as a peft LoRA adapter for the transformers class
    `architecture`.

    Args:
      model: a tfx model with LoRA attached (`tfx.peft.LoRA(...).attach`), stacked or not.
      directory: the folder to write (created if needed; the two files are overwritten).
      architecture: one of `ARCHITECTURES`, the class the base model is saved as
        (`tfx.hf.save(model, path, architecture=...)`) or was loaded from.
      base_model: `base_model_name_or_path` of the adapter config (a Hub id or folder).

    peft's scale is lora_alpha / r: the config gets lora_alpha = scale · r (and, for fused
    modules of rank k·r, alpha_pattern scale · k·r) and use_rslora false, which gives the same
    scale whichever rule tfx's LoRA used.

    Raises ValueError for an unsupported architecture or one that cannot express the model, a
    model without LoRA factors, a factor on a weight with no peft module (e.g. a router),
    factors of different ranks, and LoRA on tied token embeddings (peft's embedding adapter does
    not reach the tied lm_head).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)} (those whose "
                         f"weights map onto transformers modules), got {architecture!r}")
    if not isinstance(directory, str | pathlib.Path):
        raise TypeError(f"directory must be a str or pathlib.Path, got {type(directory).__name__}")
    if base_model is not None and not isinstance(base_model, str):
        raise TypeError(f"base_model must be a str or None, got {type(base_model).__name__}")
    weights = weights_of(model)  # ValueError when there are none
    config, export = model.config, ARCHITECTURES[architecture]
    family = by_architecture()[architecture]
    if getattr(config, "moe", None) is not None and not getattr(family, "HAS_EXPERTS", False):
        raise ValueError(f"architecture {architecture} cannot express a model with experts")
    family.config_to_hf(config, architecture)  # ValueError for a model it cannot express
    modules = export.modules(config)
    ranks = sorted({f.a.shape[-1] for f in weights.factors.values()})
    if len(ranks) > 1:
        raise ValueError(f"the model's LoRA factors have ranks {ranks}; a peft adapter "
                         "exported by tfx has one rank")
    if config.embeddings.tie and "embeddings/tokens" in weights.factors:
        raise ValueError(f"LoRA on tied token embeddings cannot be exported to {architecture}: "
                         "peft's embed_tokens adapter leaves the tied lm_head unchanged")
    factors = _per_layer(weights.factors, config.compute.scan_layers)
    _check_targets(factors, modules, export, architecture)
    tensors, module_ranks = _adapter_tensors(model, factors, modules)
    available = {name for name, _ in modules.one.values()} | set(modules.fused)
    adapter_config = _adapter_config(
        rank=ranks[0], scale=weights.scale, dropout=_dropout(model), task_type=export.task_type,
        targets=sorted(_by_name(dict.fromkeys(module_ranks, True), available)),
        base_model=base_model, fan_in_fan_out=export.fan_in_fan_out,
        rank_pattern=_by_name({n: r for n, r in module_ranks.items() if r != ranks[0]},
                              set(module_ranks)))
    _write(pathlib.Path(directory), tensors, adapter_config)


def _adapter_tensors(model: nnx.Module, factors: dict, modules: _Modules
                     ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """peft's tensors for every adapted module (by name), and each module's rank."""
    tables = {path_name(p): m.table[...] for p, m in find_modules(model, LoRAEmbedding)}
    tensors, ranks = {}, {}
    for path, (a, b) in factors.items():
        if path in modules.one:
            hf_name, leaf = modules.one[path]
            tensors |= _tensors(hf_name, a, b, tables[_kind(path)] if leaf == "table" else None)
            ranks[hf_name] = a.shape[-1]
    # out_features, not the kernel's shape: a quantized kernel (tfx.quant) may be packed.
    # By path: layers of different kinds (Qwen3.5's linear and full) have different widths;
    # stacked layers are found without their layer number.
    widths = {path_name(p): m.out_features for p, m in find_modules(model, nnx.Linear)}
    for hf_name, (parts, pack) in modules.fused.items():
        if any(part in factors for part in parts):
            a, b = _fused_factors([factors.get(part) for part in parts],
                                  [widths.get(path_name(part)) or widths[_kind(part)]
                                   for part in parts], pack)
            tensors |= _tensors(hf_name, a, b)
            ranks[hf_name] = a.shape[-1]
    return tensors, ranks


def _check_targets(factors: dict, modules: _Modules, export: _Export, architecture: str) -> None:
    """ValueError naming the first factor with no torch module that peft would adapt."""
    packed = {part for parts, _ in modules.fused.values() for part in parts}
    for path in sorted(factors, key=str):
        if path not in modules.one and path not in packed:
            kinds = {_kind(p) for p in (*modules.one, *packed)}
            raise ValueError(f"LoRA factors on {path_name(path)} have no {architecture} module "
                             "to go to (peft adapts whole torch linear layers and embeddings; "
                             "transformers keeps routers and experts otherwise); it has "
                             f"modules for {sorted(kinds)}")
        hf_name = modules.one.get(path, ("",))[0]
        if _short(hf_name) in export.taken:
            raise ValueError(f"LoRA factors on {path_name(path)} cannot be exported to "
                             f"{architecture}: peft reads a target named {_short(hf_name)} on "
                             f"it as the experts (fused by transformers 5), not as {hf_name}; "
                             "keep LoRA off the MLPs")


def _modules(tensor_names: dict[Path, str]) -> dict[Path, tuple[str, str]]:
    """tfx parameter path -> HF tensor name, reduced to adaptable weights: module path ->
    (HF module name, e.g. "model.layers.0.self_attn.q_proj"; "kernel" or "table")."""
    return {path[:-1]: (name.removesuffix(".weight"), path[-1])
            for path, name in tensor_names.items() if path[-1] in _WEIGHTS}


def _fused(packed: dict[str, tuple[Path, ...]], pack: Pack
           ) -> dict[str, tuple[tuple[Path, ...], Pack]]:
    """A family's packed tensors (name -> parameter paths; biases too) -> fused module name ->
    (the module paths of the linear layers whose kernels it packs, `pack`)."""
    return {name.removesuffix(".weight"): (tuple(path[:-1] for path in paths), pack)
            for name, paths in packed.items() if name.endswith(".weight")}


def _tensors(hf_name: str, a: np.ndarray, b: np.ndarray, table=None) -> dict[str, np.ndarray]:
    """peft's tensors of one module from tfx factors a [d_in, r], b [r, d_out]: a linear
    layer's, or an embedding's when `table` [vocab, d] is its base weight."""
    prefix = f"base_model.model.{hf_name}"
    if table is None:
        return {f"{prefix}.lora_A.weight": a.T, f"{prefix}.lora_B.weight": b.T}
    # peft saves an adapted embedding's base weight too (save_embedding_layers="auto").
    return {f"{prefix}.lora_embedding_A": a.T, f"{prefix}.lora_embedding_B": b.T,
            f"{prefix}.base_layer.weight": np.asarray(table)}


def _fused_factors(parts: list[tuple[np.ndarray, np.ndarray] | None], widths: list[int],
                   pack: Callable[[list[np.ndarray]], np.ndarray]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """One LoRA (a [d_in, k·r], b [k·r, d_out]) for a fused module, from its parts' factors
    (a_j [d_in, r], b_j [r, n_j], or None for a part without) and output widths n_j: the a_j
    side by side, the b_j on a block diagonal packed as the family packs kernels, so that
    a·b = pack([a_j·b_j]) with zero blocks for the parts without factors."""
    adapted = [(j, f) for j, f in enumerate(parts) if f is not None]
    a = np.concatenate([np.asarray(f[0]) for _, f in adapted], axis=-1)
    r = adapted[0][1][0].shape[-1]
    blocks = [np.zeros((a.shape[-1], n), a.dtype) for n in widths]
    for slot, (j, (_, b)) in enumerate(adapted):
        blocks[j][slot * r:(slot + 1) * r] = b
    return a, pack(blocks)


def _per_layer(factors: dict, stacked: bool) -> dict[Path, tuple[np.ndarray, np.ndarray]]:
    """{module path: (a, b)} with stacked layers' leading [num_layers] axis split into layers."""
    flat = {}
    for name, f in factors.items():
        path = tuple(int(p) if p.isdigit() else p for p in name.split("/"))
        flat[(*path, "a")], flat[(*path, "b")] = np.asarray(f.a), np.asarray(f.b)
    if stacked:
        flat = io.unstack_layers(flat)
    return {path[:-1]: (flat[path], flat[(*path[:-1], "b")])
            for path in flat if path[-1] == "a"}


def _kind(path: Path) -> str:
    """A module path without its layer number: "stack/layers/attention/query"."""
    return path_name(tuple(p for p in path if not isinstance(p, int)))


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _by_name(values: dict[str, object], among: set[str]) -> dict[str, object]:
    """`values` (HF module name -> value) keyed as peft matches names (target_modules,
    rank_pattern): by a module's short name ("q_proj") where every module of `among` with that
    name has the same value, else by its full name (a short name applies to every layer)."""
    out = {}
    for name, value in values.items():
        same = all(values.get(n) == value for n in among if _short(n) == _short(name))
        out[_short(name) if same else name] = value
    return out


def _dropout(model: nnx.Module) -> float:
    rates = {m.lora_dropout.rate for _, m in find_modules(model, LoRALinear)}
    return rates.pop() if len(rates) == 1 else 0.0


def _alpha(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _adapter_config(*, rank: int, scale: float, dropout: float, task_type: str,
                    targets: list[str], base_model: str | None, fan_in_fan_out: bool,
                    rank_pattern: dict[str, int]) -> dict:
    """The adapter_config.json fields that matter to a plain LoRA adapter; peft fills in the
    rest with its defaults when it reads the file."""
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": _alpha(scale * rank), "use_rslora": False,
        "target_modules": targets, "lora_dropout": dropout, "bias": "none",
        "fan_in_fan_out": fan_in_fan_out, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "rank_pattern": rank_pattern,
        "alpha_pattern": {name: _alpha(scale * r) for name, r in rank_pattern.items()},
        "layers_to_transform": None, "layers_pattern": None, "use_dora": False,
        "revision": None,
    }


def _write(folder: pathlib.Path, tensors: dict[str, np.ndarray], adapter_config: dict) -> None:
    from safetensors.numpy import save_file

    if folder.exists() and not folder.is_dir():
        raise ValueError(f"directory {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    # Each file is written beside its place and renamed in: a failed save keeps the old one.
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    staged = [weights.with_name(weights.name + ".partial"),
              config.with_name(config.name + ".partial")]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(staged[0]),
              metadata={"format": "pt"})
    staged[1].write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    for partial, final in zip(staged, (weights, config), strict=True):
        os.replace(partial, final)
