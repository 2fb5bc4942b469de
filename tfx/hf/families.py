"""The family modules of `tfx.hf`, found by looking: each maps the config.json and tensors of the
Hugging Face architectures it lists (`ARCHITECTURES`) onto a tfx model and back, through the
names of `INTERFACE`. What a family is lives in its card (`tfx.models.families`); its module
reads the card and the sizes of config.json. A new family is a card and a module
(`tfx/hf/<family>.py`): `by_architecture` finds every module of this package that defines
`config_from_hf`, so no list names the families.

Multimodal checkpoints (a `*ForConditionalGeneration` whose config.json nests the text model's
fields in "text_config" beside a "vision_config", its tensors under a prefix beside the vision
tower's) are read as their text model: a family module declares, in `MULTIMODAL`, each such
architecture as a `Multimodal` (its text architecture, the tensor prefixes of the text model
and those of the towers), and `for_loading` gives the `TextOf` family that reads it through
the text architecture's module. Only loading reads them: a model is saved as the text class
(`tfx.hf.save(model, path, architecture="Qwen3_5ForCausalLM")`, a `*ForCausalLM`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import pkgutil
import re
from collections.abc import Iterable, Mapping
from types import ModuleType

from tfx.hf import plan

__all__ = ["INTERFACE", "Multimodal", "TextOf", "by_architecture", "for_loading"]

# What a family module defines: tfx.hf.load, save, export and the peft adapter files call these.
INTERFACE = ("ARCHITECTURES", "IGNORED", "OPTIONAL_PARAMS", "config_from_hf", "config_to_hf",
             "params_from_hf", "params_to_hf", "steps")


@functools.cache
def _family_modules() -> tuple[ModuleType, ...]:
    """Every module of this package that reads a config.json (`config_from_hf`), by name.

    Importing them all is safe: a module of tfx.hf only defines things, and the package itself
    is imported already. The package is named by `__package__` and this file's folder, not
    imported by name, so the import graph (tests/test_import_cycles.py) gets no edge back to
    `tfx.hf`, whose `load` calls here."""
    folder = str(pathlib.Path(__file__).parent)
    modules = [importlib.import_module(f"{__package__}.{info.name}")
               for info in pkgutil.iter_modules([folder])]
    # `ARCHITECTURES` alone is no mark: tfx.hf.peft_adapter has its own, of adapter writers.
    return tuple(module for module in modules if hasattr(module, "config_from_hf"))


def by_architecture() -> dict[str, ModuleType]:
    """Architecture name (config.json "architectures") -> its family module."""
    return {arch: module for module in _family_modules() for arch in module.ARCHITECTURES}


def for_loading() -> dict:
    """`by_architecture`, and each multimodal architecture a family module declares (its
    `MULTIMODAL`) -> the `TextOf` family that reads its text model: what `tfx.hf.load` reads.
    """
    families = by_architecture()
    return families | {architecture: TextOf(architecture, declared, families[declared.text])
                       for module in _family_modules()
                       for architecture, declared in getattr(module, "MULTIMODAL", {}).items()}


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """Where the text model of a multimodal architecture lies in its checkpoints.

    Attributes:
      text: the text architecture whose module maps it, e.g. "Qwen3_5ForCausalLM".
      tensors: checkpoint name prefix -> the prefix of the same tensors in the text
        architecture's checkpoints, e.g. {"model.language_model.": "model.", "lm_head.":
        "lm_head."}; several layouts of one architecture may be listed (the first is the one
        a missing tensor is named in).
      towers: name prefixes of the tensors that are not the text model's (vision or audio
        tower, projector), which are not read.
      tie_word_embeddings: the multimodal config class's default, for a config.json whose
        top level leaves it out (transformers then ignores text_config's).
    """

    text: str
    tensors: Mapping[str, str]
    towers: tuple[str, ...]
    tie_word_embeddings: bool


class TextOf:
    """The family (`INTERFACE`'s loading half) of a multimodal architecture's text model: its
    config is config.json's "text_config" but for tie_word_embeddings, which the top level
    says (the outer model holds the LM head: transformers ties it by the outer config's flag
    whatever text_config says), and its plan is the text architecture's with
    each tensor named as the checkpoint names it (`Multimodal.tensors`). Tower tensors are
    ignored by name; any other tensor outside the text model's prefixes is unexpected.

    Attributes:
      ARCHITECTURES: the multimodal architecture, alone.
      IGNORED: the text family's ignored tensors (under the checkpoint's prefixes too) and
        the towers'.
      OPTIONAL_PARAMS: the text family's.
    """

    def __init__(self, architecture: str, declared: Multimodal, family: ModuleType):
        self.architecture, self.declared, self.family = architecture, declared, family
        self.ARCHITECTURES = (architecture,)
        self.OPTIONAL_PARAMS = family.OPTIONAL_PARAMS
        moved = [re.escape(outer) + pattern[len(re.escape(inner)):]
                 for pattern in family.IGNORED for outer, inner in declared.tensors.items()
                 if pattern.startswith(re.escape(inner))]
        self.IGNORED = (*family.IGNORED, *moved,
                        *(re.escape(prefix) + ".*" for prefix in declared.towers))

    def text_fields(self, hf: dict) -> dict:
        """The text model's config.json fields: "text_config" (absent: the text config
        class's defaults, as transformers builds it) and the top level's tie_word_embeddings
        (absent: `Multimodal.tie_word_embeddings`)."""
        text = hf.get("text_config", {})
        if not isinstance(text, dict):
            raise ValueError(f"{self.architecture}: config.json's \"text_config\" must be a "
                             f"JSON object (the text model's fields), got {text!r}")
        tied = hf.get("tie_word_embeddings", self.declared.tie_word_embeddings)
        return {**text, "tie_word_embeddings": tied}

    def config_from_hf(self, hf: dict, architecture: str):
        """The tfx config of the text model of a config.json of `architecture`; ValueError
        naming `architecture`'s text_config for what the text family refuses."""
        try:
            return self.family.config_from_hf(self.text_fields(hf), self.declared.text)
        except ValueError as error:
            raise ValueError(f"{architecture} text_config (read as {self.declared.text}): "
                             f"{error}") from None

    def steps(self, names: Iterable[str], config) -> list[plan.Step]:
        """The text architecture's plan (see `tfx.hf.plan`) for the text model's tensors of
        `names`, reading each under its name in the checkpoint."""
        names = list(names)
        text = self._text_names(names)
        used = [outer for outer in self.declared.tensors
                if any(name.startswith(outer) for name in names)]
        return plan.renamed(self.family.steps(list(text), config),
                            lambda name: text.get(name) or self._outer_name(name, used))

    def _text_names(self, names: list[str]) -> dict[str, str]:
        """Text-model name -> checkpoint name, for the checkpoint's tensors of the text model
        (those under one of `Multimodal.tensors`' prefixes, the longest that fits);
        ValueError when two of them are one text tensor (two layouts mixed)."""
        prefixes = sorted(self.declared.tensors, key=len, reverse=True)
        text: dict[str, str] = {}
        for name in sorted(names):
            outer = next((prefix for prefix in prefixes if name.startswith(prefix)), None)
            if outer is None:
                continue
            inner = self.declared.tensors[outer] + name[len(outer):]
            if inner in text:
                raise ValueError(f"{self.architecture}: checkpoint tensors {text[inner]} and "
                                 f"{name} are both the text model's {inner} (two layouts of "
                                 "the checkpoint mixed in one folder)")
            text[inner] = name
        return text

    def _outer_name(self, inner: str, used: list[str]) -> str:
        """The checkpoint name of a text-model tensor the checkpoint lacks, in the layout the
        checkpoint uses (else the first declared), for the error naming it."""
        fits = [outer for outer, prefix in self.declared.tensors.items()
                if inner.startswith(prefix)]
        outer = next((prefix for prefix in fits if prefix in used), fits[0] if fits else None)
        if outer is None:
            return inner
        return outer + inner[len(self.declared.tensors[outer]):]
