"""Export a tfx model's LoRA factors as a peft adapter folder: `adapter_model.safetensors` and
`adapter_config.json`, as peft's `save_pretrained` writes them, so that
`peft.PeftModel.from_pretrained(hf_model, folder)` puts the same adapter on the transformers
model that `tfx.hf.save(model, ..., architecture=)` writes.

Layouts. tfx keeps a linear layer's factors as a [d_in, r] and b [r, d_out] (ΔW = scale·a·b on a
kernel [d_in, d_out]); peft keeps `lora_A.weight` [r, d_in] and `lora_B.weight` [d_out, r] on a
torch weight [d_out, in] (ΔW = scale·B·A). An embedding's a [vocab, r], b [r, d] become
`lora_embedding_A` [r, vocab] and `lora_embedding_B` [d, r]. Every factor is transposed, and
stacked layers (scan_layers) are written one layer at a time.

Only weights that are one whole torch module can be exported: LLaMA / Mistral / Mixtral attention
and dense MLP projections, embeddings and an untied head, and BERT's linear layers and word
embeddings. GPT-2 fuses q/k/v into one Conv1D and Mixtral's experts are not linear layers, so
their factors have no peft equivalent.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
from flax import nnx

from tfx.hf import bert, io, llama, mixtral
from tfx.nn.paths import path_name
from tfx.peft.core import find_modules
from tfx.peft.lora import weights_of
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear

__all__ = ["ARCHITECTURES", "save_peft_adapter"]

Path = tuple[str | int, ...]
_WEIGHTS = ("kernel", "table")  # the leaf names of what LoRA adapts (linear, embedding)


def _llama_modules(config, architecture: str) -> dict[Path, tuple[str, str]]:
    family = mixtral if architecture in mixtral.ARCHITECTURES else llama
    family.config_to_hf(config, architecture)  # ValueError for a model it cannot express
    return _modules(llama.tensor_names(config))


def _bert_modules(config, architecture: str) -> dict[Path, tuple[str, str]]:
    bert.config_to_hf(config, architecture)
    # BertModel has the encoder and the pooler, not the masked-LM head.
    groups = bert.tensor_table(config)
    return _modules({path: name for group in ("encoder", "pooler")
                     for name, path, _ in groups[group]})


# architecture -> (function of the config giving `_modules`, peft task_type)
ARCHITECTURES = {
    "LlamaForCausalLM": (_llama_modules, "CAUSAL_LM"),
    "MistralForCausalLM": (_llama_modules, "CAUSAL_LM"),
    "MixtralForCausalLM": (_llama_modules, "CAUSAL_LM"),
    "BertModel": (_bert_modules, "FEATURE_EXTRACTION"),
}


def save_peft_adapter(model: nnx.Module, directory: str | pathlib.Path, *, architecture: str,
                      base_model: str | None = None) -> None:
    """Write `model`'s LoRA factors as a peft LoRA adapter for the transformers class
    `architecture`.

    Args:
      model: a tfx model with LoRA attached (`tfx.peft.LoRA(...).attach`), stacked or not.
      directory: the folder to write (created if needed; the two files are overwritten).
      architecture: one of `ARCHITECTURES`, the class the base model is saved as
        (`tfx.hf.save(model, path, architecture=...)`).
      base_model: `base_model_name_or_path` of the adapter config (a Hub id or folder).

    peft's scale is lora_alpha / r: the config gets lora_alpha = scale · r and use_rslora false,
    which gives the same scale whichever rule tfx's LoRA used.

    Raises ValueError for an unsupported architecture, a model without LoRA factors, a factor on
    a weight with no peft module (e.g. Mixtral's router), factors of different ranks, and LoRA
    on tied token embeddings (peft's embedding adapter does not reach the tied lm_head).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)} (weights that "
                         f"map one-to-one onto transformers modules), got {architecture!r}")
    if not isinstance(directory, str | pathlib.Path):
        raise TypeError(f"directory must be a str or pathlib.Path, got {type(directory).__name__}")
    if base_model is not None and not isinstance(base_model, str):
        raise TypeError(f"base_model must be a str or None, got {type(base_model).__name__}")
    weights = weights_of(model)  # ValueError when there are none
    names, task_type = ARCHITECTURES[architecture]
    config = model.config
    hf_modules = names(config, architecture)
    ranks = sorted({f.a.shape[-1] for f in weights.factors.values()})
    if len(ranks) > 1:
        raise ValueError(f"the model's LoRA factors have ranks {ranks}; a peft adapter "
                         "exported by tfx has one rank")
    if config.embeddings.tie and "embeddings/tokens" in weights.factors:
        raise ValueError(f"LoRA on tied token embeddings cannot be exported to {architecture}: "
                         "peft's embed_tokens adapter leaves the tied lm_head unchanged")
    factors = _per_layer(weights.factors, config.compute.scan_layers)
    tables = {path_name(p): np.asarray(m.table[...])
              for p, m in find_modules(model, LoRAEmbedding)}
    tensors = {}
    for path, (a, b) in sorted(factors.items(), key=lambda item: str(item[0])):
        if path not in hf_modules:
            raise ValueError(f"LoRA factors on {path_name(path)} have no "
                             f"{architecture} module to go to; it has modules for "
                             f"{sorted({_kind(p) for p in hf_modules})}")
        hf_name, leaf = hf_modules[path]
        prefix = f"base_model.model.{hf_name}"
        if leaf == "table":
            tensors[f"{prefix}.lora_embedding_A"] = a.T
            tensors[f"{prefix}.lora_embedding_B"] = b.T
            # peft saves an adapted embedding's base weight too (save_embedding_layers="auto").
            tensors[f"{prefix}.base_layer.weight"] = tables[_kind(path)]
        else:
            tensors[f"{prefix}.lora_A.weight"] = a.T
            tensors[f"{prefix}.lora_B.weight"] = b.T
    adapter_config = _adapter_config(
        rank=ranks[0], scale=weights.scale, dropout=_dropout(model), task_type=task_type,
        targets=_target_modules({hf_modules[p][0] for p in factors},
                                {name for name, _ in hf_modules.values()}),
        base_model=base_model)
    _write(pathlib.Path(directory), tensors, adapter_config)


def _modules(tensor_names: dict[Path, str]) -> dict[Path, tuple[str, str]]:
    """tfx parameter path -> HF tensor name, reduced to adaptable weights: module path ->
    (HF module name, e.g. "model.layers.0.self_attn.q_proj"; "kernel" or "table")."""
    return {path[:-1]: (name.removesuffix(".weight"), path[-1])
            for path, name in tensor_names.items() if path[-1] in _WEIGHTS}


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


def _target_modules(adapted: set[str], available: set[str]) -> list[str]:
    """peft's target_modules for exactly the `adapted` HF modules: a module's short name
    ("q_proj") when every module of that name is adapted, else its full name."""
    out = set()
    for name in adapted:
        short = name.rpartition(".")[2]
        same = {n for n in available if n.rpartition(".")[2] == short}
        out.add(short if same <= adapted else name)
    return sorted(out)


def _dropout(model: nnx.Module) -> float:
    rates = {m.lora_dropout.rate for _, m in find_modules(model, LoRALinear)}
    return rates.pop() if len(rates) == 1 else 0.0


def _adapter_config(*, rank: int, scale: float, dropout: float, task_type: str,
                    targets: list[str], base_model: str | None) -> dict:
    """The adapter_config.json fields that matter to a plain LoRA adapter; peft fills in the
    rest with its defaults when it reads the file."""
    alpha = scale * rank
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "use_rslora": False, "target_modules": targets, "lora_dropout": dropout,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "rank_pattern": {},
        "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "use_dora": False, "revision": None,
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
