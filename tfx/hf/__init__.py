"""Hugging Face checkpoints: `load` a save_pretrained folder (config.json + safetensors) into a
tfx model, `save` a tfx model as a folder that transformers loads.

Supported architectures (config.json "architectures"): BertModel, GPT2LMHeadModel,
LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, T5ForConditionalGeneration. The
returned module's call mirrors the Hugging Face class, with the same keyword names, and returns
float32 arrays.
"""

from __future__ import annotations

import pathlib

from flax import nnx

from tfx.hf import io
from tfx.models import create

__all__ = ["SUPPORTED", "load", "save"]


def _families() -> dict:
    from tfx.hf import bert, gpt2, llama, mixtral, t5

    return {arch: family for family in (bert, gpt2, llama, mixtral, t5)
            for arch in family.ARCHITECTURES}


def __getattr__(name):  # SUPPORTED is computed lazily to keep imports light
    if name == "SUPPORTED":
        return tuple(sorted(_families()))
    raise AttributeError(name)


def load(path: str | pathlib.Path, **overrides) -> nnx.Module:
    """Load a transformers save_pretrained folder.

    Args:
      path: folder with config.json and model.safetensors (or a sharded index).
      overrides: config fields that change how, not what, the model computes, e.g.
        `dtype="bfloat16"` (compute dtype; weights stay float32), `implementation="blocked"`,
        `remat=True`, `scan_layers=True`.
    Returns:
      an NNX module in eval mode (dropout off) whose call mirrors `config.architectures[0]`.
    """
    folder = pathlib.Path(path)
    hf_config = io.read_config(folder)
    architecture = _architecture(hf_config, folder)
    family = _families()[architecture]
    config = family.config_from_hf(hf_config, architecture)
    if overrides:
        config = config.replace(**overrides)
    model = create(config)
    params = family.params_from_hf(io.read_tensors(folder), config)
    if config.scan_layers:
        params = io.stack_layers(params)
    # Heads a checkpoint may lack (a family's OPTIONAL_PARAMS) keep their initial values.
    io.assign_params(model, params, source=str(folder), optional=family.OPTIONAL_PARAMS)
    model.eval()
    return model


def save(model: nnx.Module, path: str | pathlib.Path, *, architecture: str) -> None:
    """Write `model` as a transformers folder of the given architecture (e.g. "LlamaForCausalLM").

    The folder is written to a temporary place and renamed, so a failing save never leaves a
    broken checkpoint behind or overwrites a good one.
    """
    families = _families()
    if architecture not in families:
        raise ValueError(f"architecture must be one of {sorted(families)}, got {architecture!r}")
    family = families[architecture]
    experts = getattr(model.config, "num_experts", 0)
    if experts and not getattr(family, "HAS_EXPERTS", False):
        with_experts = sorted(a for a, f in families.items() if getattr(f, "HAS_EXPERTS", False))
        raise ValueError(f"{architecture} cannot express num_experts={experts} (a model with "
                         f"experts saves as one of {with_experts})")
    hf_config = family.config_to_hf(model.config, architecture)
    params = io.flat_params(model)
    if model.config.scan_layers:
        params = io.unstack_layers(params)
    tensors = family.params_to_hf(params, model.config)
    io.write_folder(pathlib.Path(path), hf_config, tensors)


def _architecture(hf_config: dict, folder: pathlib.Path) -> str:
    names = hf_config.get("architectures") or []
    families = _families()
    for name in names:
        if name in families:
            return name
    raise ValueError(f"{folder / 'config.json'}: architectures {names} not supported; "
                     f"tfx loads {sorted(families)}")
