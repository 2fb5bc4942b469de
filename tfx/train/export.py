"""A trained run as a folder other tools read (`tfx export --workdir DIR --to FOLDER`):

- a Hugging Face folder (`config.json` + safetensors, what transformers' `from_pretrained`
  reads): a full fine-tune, a run trained from scratch, or a LoRA run with `merged=True`, its
  factors merged into the weights (W + scale·a·b, `tfx.peft.lora.merge`). The architecture is
  the base folder's when the run started from a Hugging Face folder, else the first that
  expresses the model (`hf_architecture`: LlamaForCausalLM for a plain RoPE decoder);
- a peft adapter folder (`adapter_config.json` + `adapter_model.safetensors`,
  `tfx.hf.peft_adapter`), the default for a LoRA run that started from a Hugging Face folder:
  `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), FOLDER)`, where
  the adapter config names the base folder by its absolute path.

Either way the run's tokenizer files come along (`TOKENIZER_FILES`, from the folder
`data.tokenizer` names: the base folder when the run started from one), so `AutoTokenizer`
reads the folder too. A byte-level run (data.tokenizer "byte") has no Hugging Face tokenizer:
none is written (its ids are the UTF-8 bytes, then the objective's special tokens), and a
UserWarning says so.

Nothing is written until everything is checked (the run, its method, the folder, the
architecture), and then into a temporary folder beside `to`, renamed into place at the end: a
failing export leaves no half folder, and an existing non-empty `to` is never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from flax import nnx

import tfx.hf
from tfx.hf import io
from tfx.hf.families import TextOf, by_architecture, for_loading
from tfx.hf.peft_adapter import ARCHITECTURES, save_peft_adapter
from tfx.peft import PeftParam, lora
from tfx.peft.core import find_modules
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear
from tfx.train.config import Experiment, non_empty_path
from tfx.train.pretrained import is_hf_base
from tfx.train.run import initial_model, load_run, stored_experiment

__all__ = ["TOKENIZER_FILES", "export_run", "hf_architecture"]

# What AutoTokenizer (fast or slow) and generate read beside the weights, when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")
# The order `hf_architecture` tries: the most widely read first (LLaMA reads every plain RoPE
# decoder), then the families with more parts; an architecture tfx adds later comes last.
_PREFERRED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM",
              "Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "GPT2LMHeadModel",
              "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
              "Olmo2ForCausalLM", "DeepseekV3ForCausalLM", "BertForMaskedLM", "BertModel",
              "T5ForConditionalGeneration")
# The base config.json's token ids a tfx config does not keep (it keeps the pad id only);
# transformers' pipelines read them from config.json.
_TOKEN_IDS = ("bos_token_id", "eos_token_id")


def export_run(workdir: str | Path, to: str | Path, *, merged: bool | None = None) -> Path:
    """Write the run trained in `workdir` (its newest checkpoint) as a new folder `to`.

    Args:
      workdir: the run's folder (`tfx train --workdir`).
      to: the folder to write; it must not exist or be empty.
      merged: LoRA runs: True writes a Hugging Face folder with the factors merged into the
        weights, False a peft adapter (which needs the Hugging Face folder the run started
        from); None: an adapter when the run started from a Hugging Face folder, else merged.
        Full fine-tunes and runs from scratch always write a Hugging Face folder (False is
        refused).
    Returns:
      `to`, written.
    Raises:
      ValueError: naming the argument at fault: `--to` exists and is not an empty folder;
        `--workdir` holds no run or no checkpoint; the run's method is neither full
        fine-tuning nor LoRA; `merged=False` for a run that cannot be an adapter; no
        architecture tfx saves can express the model (`hf_architecture`); the run's
        tokenizer is gone. Raised before anything is written.
    Warns:
      UserWarning: a byte-level run's export has no tokenizer.
    """
    to = _checked_destination(to)
    experiment = stored_experiment(workdir)  # ValueError naming the workdir when there is none
    method = experiment.peft.method
    if method not in ("full", "lora"):
        raise ValueError(f"--workdir {workdir} trained peft.method={method!r}: only full "
                         "fine-tuning and LoRA runs export (transformers has no place for "
                         f"tfx's {method} parameters)")
    base = experiment.train.init_from
    hf_base = Path(base).resolve() if is_hf_base(base) else None
    adapter = _writes_adapter(method, merged, hf_base, workdir, base)
    architecture = _base_architecture(hf_base) if hf_base else hf_architecture(experiment.model)
    if adapter and architecture not in ARCHITECTURES:
        raise ValueError(f"--merged: a peft adapter for {architecture} is not written (tfx "
                         f"writes adapters for {sorted(ARCHITECTURES)}); export with "
                         "merged=True (--merged True)")
    tokenizer = _tokenizer_files(experiment)
    run = load_run(workdir)  # ValueError naming the workdir when it has no checkpoint yet
    to.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{to.name}.", suffix=".export", dir=to.parent))
    try:
        folder = staging / to.name
        if adapter:
            save_peft_adapter(run.model, folder, architecture=architecture,
                              base_model=str(hf_base))
        else:
            _save_merged(_float_base(experiment, run.model), folder, architecture, hf_base)
        for source, name in tokenizer:
            shutil.copyfile(source, folder / name)
        try:
            os.replace(folder, to)  # onto an empty folder too; never onto a non-empty one
        except OSError as error:
            raise ValueError(f"--to {to}: could not put the export in place ({error})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if experiment.data.tokenizer == "byte":
        warnings.warn(f"exported {to} without a tokenizer: the run's is byte-level "
                      "(data.tokenizer='byte'), which has no Hugging Face form (its ids are "
                      "UTF-8 bytes, then the objective's special tokens)", stacklevel=2)
    return to


def hf_architecture(model) -> str:
    """The first transformers architecture (in `_PREFERRED` order) that tfx saves and that
    expresses the model config `model` exactly: "LlamaForCausalLM" for a RoPE decoder with
    RMSNorm and a SwiGLU MLP, "GPT2LMHeadModel" for learned positions and LayerNorm, ...

    Raises ValueError naming `model` when none does, with each architecture's reason."""
    families = by_architecture()
    order = [*(a for a in _PREFERRED if a in families), *sorted(set(families) - set(_PREFERRED))]
    experts = getattr(model, "moe", None) is not None
    reasons = []
    for architecture in order:
        family = families[architecture]
        if experts and not getattr(family, "HAS_EXPERTS", False):
            reasons.append(f"{architecture}: no experts")
            continue
        try:
            family.config_to_hf(model, architecture)
        except ValueError as error:
            reasons.append(str(error))
            continue
        return architecture
    raise ValueError("model: no Hugging Face architecture tfx saves can express it: "
                     + "; ".join(reasons))


def _checked_destination(to: str | Path) -> Path:
    """`to` as a Path, refused unless it is absent or an empty folder."""
    non_empty_path("--to", to)
    to = Path(to)
    if to.exists() and not to.is_dir():
        raise ValueError(f"--to {to} exists and is not a folder")
    if to.is_dir() and any(to.iterdir()):
        raise ValueError(f"--to {to} is not empty: export writes a new folder and never "
                         "overwrites one (choose another --to, or remove it)")
    return to


def _writes_adapter(method: str, merged: bool | None, hf_base: Path | None, workdir,
                    base: str | None) -> bool:
    """Whether the export is a peft adapter (else a Hugging Face folder)."""
    if merged is not None and not isinstance(merged, bool):
        raise TypeError(f"--merged must be True, False or None, got {merged!r}")
    if method == "full":
        if merged is False:
            raise ValueError(f"--merged: {workdir} trained every weight, so there is no "
                             "adapter to write (merged=False is for LoRA runs)")
        return False
    if merged is False and hf_base is None:
        raise ValueError(f"--merged: a peft adapter needs the Hugging Face folder the run "
                         f"started from as its base; {workdir} started from {base!r} "
                         "(train.init_from): export with merged=True (--merged True)")
    return hf_base is not None if merged is None else not merged


def _base_architecture(folder: Path) -> str:
    """The first architecture of the base folder's config.json that tfx saves: a multimodal
    one (Qwen3.5's, Gemma 3's) saves as its text architecture, the model tfx loaded from it."""
    names = io.read_config(folder).get("architectures") or []
    loadable = for_loading()
    for name in names:
        if name in tfx.hf.SUPPORTED:
            return name
        if isinstance(loadable.get(name), TextOf):
            return loadable[name].declared.text
    raise ValueError(f"--workdir: its base {folder} names architectures {names}, none of "
                     f"which tfx saves ({list(tfx.hf.SUPPORTED)})")


def _tokenizer_files(experiment: Experiment) -> list[tuple[Path, str]]:
    """(file, name in the export) of the run's tokenizer: the `TOKENIZER_FILES` of its folder,
    or its tokenizers file as tokenizer.json; none for a byte-level run, which has no Hugging
    Face tokenizer. ValueError when the tokenizer is gone."""
    spec = experiment.data.tokenizer
    if spec == "byte":
        return []
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"--workdir: the run's tokenizer {spec} (data.tokenizer) is gone, so "
                         "the export would have none")
    if not path.is_dir():  # a tokenizers JSON file, whatever its name: AutoTokenizer's file
        return [(path, "tokenizer.json")]
    return [(path / name, name) for name in TOKENIZER_FILES if (path / name).is_file()]


def _float_base(experiment: Experiment, model: nnx.Module) -> nnx.Module:
    """`model` itself, or for a QLoRA run (LoRA on a base quantized by `tfx.quant`) the run's
    model built again with a float base (from train.init_from, what was quantized) carrying
    the trained factors: quantized weights take no merge, and transformers reads floats."""
    if getattr(experiment.peft, "quantize", None) is None:
        return model
    unquantized = dataclasses.replace(experiment,
                                      peft=dataclasses.replace(experiment.peft, quantize=None))
    floats, _ = initial_model(unquantized)
    nnx.update(floats, nnx.state(model, PeftParam))
    floats.eval()
    return floats


def _save_merged(model, folder: Path, architecture: str, hf_base: Path | None) -> None:
    """`tfx.hf.save` of `model`, LoRA factors (if any) merged into the weights; the base
    folder's bos/eos token ids carried into config.json."""
    if find_modules(model, (LoRALinear, LoRAEmbedding)):
        weights = lora.detach(model)  # the plain layers back, in place
        nnx.update(model, lora.merge(nnx.state(model, nnx.Param), weights))
    tfx.hf.save(model, folder, architecture=architecture)
    if hf_base is not None:
        base = io.read_config(hf_base)
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        carried = {k: base[k] for k in _TOKEN_IDS if k in base and config.get(k) is None}
        config_path.write_text(json.dumps({**config, **carried}, indent=2, sort_keys=True))
