"""Hugging Face checkpoints: `load` a save_pretrained folder (config.json + safetensors) into a
tfx model, `save` a tfx model as a folder that transformers loads.

Supported architectures (config.json "architectures"; `SUPPORTED` lists them): BertModel,
BertForMaskedLM, ModernBertModel, ModernBertForMaskedLM, GPT2LMHeadModel, SmolLM3ForCausalLM,
LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, Olmo2ForCausalLM,
Olmo3ForCausalLM, GPTNeoXForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM,
T5ForConditionalGeneration (one module each, found by `tfx.hf.families`). The returned module's call
mirrors the Hugging Face class, with the same keyword names, and returns float32 arrays.

Loading is strict: a checkpoint must hold exactly the tensors the config's model has (up to
the buffers transformers ignores too and tied copies checked equal), in float16 / bfloat16 /
float32; `load(path, strict=False)` warns about missing and unexpected tensors instead. Each
family module (`tfx.hf.gpt2`, ...) states its mapping as a `tfx.hf.plan` of steps.

Both directions stream: `load` never builds the model with random weights, and puts each
tensor on its device(s) as it is read, sharded on a mesh when there is one
(`tfx.hf.streaming`); `save` gathers one output file's parameters to the host at a time and
writes several files with an index past `max_shard_size` (`tfx.hf.saving`). Host memory stays
about the size of the parameters.

peft LoRA adapters: `load_peft_adapter(folder, model)` reads one as `tfx.peft.lora.LoRAWeights`
(`tfx.hf.peft_import`); `tfx.hf.peft_adapter.save_peft_adapter` writes one.
"""

from __future__ import annotations

import pathlib

from flax import nnx

from tfx.hf import io, plan, saving, streaming

__all__ = ["SUPPORTED", "folder_config", "is_checkpoint_folder", "load", "load_peft_adapter",
           "save"]


def _families() -> dict:
    from tfx.hf.families import by_architecture

    return by_architecture()


def _loadable() -> dict:  # the families, and multimodal architectures read as their text
    from tfx.hf.families import for_loading

    return for_loading()


def __getattr__(name):  # SUPPORTED and the peft reader come lazily to keep imports light
    if name == "SUPPORTED":
        return tuple(sorted(_families()))
    if name == "load_peft_adapter":
        from tfx.hf.peft_import import load_peft_adapter

        return load_peft_adapter
    raise AttributeError(name)


def load(path: str | pathlib.Path, *, dtype: str | None = None, mesh=None, strict: bool = True,
         **overrides) -> nnx.Module:
    """Load a transformers save_pretrained folder.

    The model is never built with random weights: it is traced for its structure, and each
    parameter is read from the files as its turn comes and put straight on its device(s), in
    the sharding `tfx.parallel` gives it on the mesh (see `tfx.hf.streaming`). Host memory
    grows by the parameters and one tensor in flight (on CPU the parameters are the memory
    they were read into: about the checkpoint's size in all).

    Args:
      path: folder with config.json and `model.safetensors`, or a sharded checkpoint with
        `model.safetensors.index.json` (each tensor is read from the shard the index names).
        Without an index only `model.safetensors` is read. Every file must lie in the folder
        (index entries with absolute paths or `..`, and symlinks out of it, are refused; a
        Hugging Face cache snapshot's links into its blobs/ are fine). See `tfx.hf.io`.
        A multimodal checkpoint (e.g. Qwen3_5ForConditionalGeneration) loads as its text
        model, which saves as the text class (`tfx.hf.families.TextOf`).
      dtype: "float32", "bfloat16" or "float16": the parameters are stored in it and the
        model computes in it (`compute.param_dtype` and `compute.dtype`), as transformers'
        `from_pretrained(dtype=)`: a float32 file loaded as "bfloat16" takes half the memory.
        None: parameters in float32, compute in the platform's default (`compute.dtype`).
      mesh: a jax Mesh (`tfx.parallel.make_mesh`) to shard the parameters over by their
        logical axes (`tfx.parallel.DEFAULT_RULES`), so a model larger than one device loads
        across many; None: the mesh of an enclosing `jax.set_mesh`, else the default device.
      strict: every tensor the model needs must be in the checkpoint, and every tensor of the
        checkpoint must have a place in the model the config describes (tied copies of the
        embeddings, checked equal, and the buffers transformers ignores too, e.g. BERT's
        position_ids, are fine): otherwise ValueError naming them, raised from the files'
        headers before the model is built. False: warn instead, as transformers does;
        unexpected tensors are not read, missing ones keep the model's initial values (only
        those parameters are initialised, as `create(config)` would).
      overrides: config fields that change how, not what, the model computes, as
        `TransformerConfig.replace` takes them (a dict changes some fields of a sub-config),
        e.g. `compute={"dtype": "bfloat16"}` (compute dtype only; weights stay float32),
        `attention={"implementation": "blocked"}`, `compute={"remat": True,
        "scan_layers": True}`.
    Returns:
      an NNX module in eval mode (dropout off) whose call mirrors `config.architectures[0]`.
      A decoder or encoder–decoder carries `generation_config`, a
      `tfx.generation.GenerationConfig` read from generation_config.json (without one, from
      config.json's eos / bos / pad ids and generation fields, as transformers does): the
      defaults of `tfx.generate`, `tfx.beam_search` and `tfx.speculative_generate`.
    Raises:
      ValueError: naming the file or tensors at fault: unreadable config.json or
        generation_config.json (not UTF-8, not JSON, not an object; a generation field out
        of range), an unsupported architecture, a quantized checkpoint
        (`quantization_config`, or weights of a dtype other than float16 / bfloat16 /
        float32), the file rules above, missing or unexpected tensors (strict), shapes that
        do not fit; `dtype` not one of the three.
      TypeError: `strict` is not a bool; `mesh` is not a jax Mesh.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if dtype is not None and dtype not in plan.FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {plan.FLOAT_DTYPES} or None, got {dtype!r}")
    mesh = streaming.resolve_mesh(mesh)
    folder = pathlib.Path(path)
    family, config = _family_and_config(folder)
    generation = io.read_generation_config(folder) if _generates(config) else None
    if dtype is not None:
        overrides["compute"] = {**overrides.get("compute", {}), "dtype": dtype,
                                "param_dtype": dtype}
    if overrides:
        config = config.replace(**overrides)
    checkpoint = io.read_tensors(folder)  # headers only
    steps, left_out = plan.check(family.steps(checkpoint.keys(), config), checkpoint,
                                 ignored=family.IGNORED, strict=strict, source=str(folder))
    model = streaming.load_model(config, steps, checkpoint, left_out=left_out,
                                 optional=family.OPTIONAL_PARAMS, mesh=mesh, source=str(folder))
    model.eval()
    if generation is not None:
        model.generation_config = generation  # static: it survives nnx.split / merge and jit
    return model


def _generates(config) -> bool:
    """Whether the model of `config` decodes with `tfx.generate` (a decoder or an
    encoder–decoder)."""
    from tfx.models.config import DecoderConfig, EncoderDecoderConfig

    return isinstance(config, DecoderConfig | EncoderDecoderConfig)


def folder_config(path: str | pathlib.Path):
    """The tfx model config of a transformers save_pretrained folder (its config.json), as
    `load` builds the model from it, without reading any weights.

    Raises:
      ValueError: as `load` does for config.json (unreadable, unsupported architecture,
        quantized, settings tfx cannot express).
    """
    return _family_and_config(pathlib.Path(path))[1]


def is_checkpoint_folder(path: str | pathlib.Path) -> bool:
    """Whether `path` is a folder holding a config.json that names its "architectures", the
    mark of a transformers save_pretrained folder (a tfx run's workdir holds none)."""
    config = pathlib.Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return "architectures" in io.read_json(config, dict, "")
    except ValueError:
        return False


def _family_and_config(folder: pathlib.Path):
    """(family module, tfx config) of the folder's config.json."""
    hf_config = io.read_config(folder)
    architecture = _architecture(hf_config, folder)
    family = _loadable()[architecture]
    return family, family.config_from_hf(hf_config, architecture)


def save(model: nnx.Module, path: str | pathlib.Path, *, architecture: str,
         max_shard_size: int | str = "5GB") -> None:
    """Write `model` as a transformers folder of the given architecture (e.g. "LlamaForCausalLM").

    Tensors keep the parameters' dtype (config.json's "dtype" says which). Up to
    `max_shard_size` of tensors (bytes, or a size such as "5GB" or "500MiB") the folder holds
    one `model.safetensors`; beyond, `model-0000i-of-0000N.safetensors` files and their
    `model.safetensors.index.json`, as save_pretrained writes them; a model with a
    `generation_config` (`tfx.generation.GenerationConfig`) gets its generation_config.json.
    Parameters are gathered to the host one file at a time, from wherever they are sharded
    (see `tfx.hf.saving`). The folder is written to a temporary place and renamed, so a
    failing save never leaves a broken checkpoint behind or overwrites a good one.

    Raises:
      ValueError: an architecture tfx does not save, or one that cannot express the model
        (naming the setting); a `max_shard_size` that is not a positive size.
    """
    families = _families()
    if architecture not in families:
        raise ValueError(f"architecture must be one of {sorted(families)}, got {architecture!r}")
    limit = saving.parse_size(max_shard_size)
    family = families[architecture]
    moe = model.config.moe
    experts = 0 if moe is None else moe.num_experts
    if experts and not getattr(family, "HAS_EXPERTS", False):
        with_experts = sorted(a for a, f in families.items() if getattr(f, "HAS_EXPERTS", False))
        raise ValueError(f"{architecture} cannot express num_experts={experts} (a model with "
                         f"experts saves as one of {with_experts})")
    saving.save_model(model, pathlib.Path(path), family, architecture, limit)


def _architecture(hf_config: dict, folder: pathlib.Path) -> str:
    """The first supported name of config.json's "architectures"; ValueError for a checkpoint
    declared quantized or naming none tfx loads."""
    where = folder / "config.json"
    quantization = hf_config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(f"{where}: quantization_config (quant_method={method!r}) declares a "
                         "quantized checkpoint; quantized checkpoints are not supported (tfx "
                         "loads float16, bfloat16 and float32 weights)")
    names = hf_config.get("architectures") or []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError(f"{where}: \"architectures\" must be a list of class names, got "
                         f"{names!r}")
    families = _loadable()
    for name in names:
        if name in families:
            return name
    raise ValueError(f"{where}: architectures {names} not supported; tfx loads "
                     f"{sorted(families)}")
