"""The family modules of `tfx.hf`, by module name: each maps the config.json and tensors of
the Hugging Face architectures it lists (`ARCHITECTURES`) onto a tfx model and back. What a
family is lives in its card (`tfx.models.families`); its module reads the card and the sizes
of config.json. A new family is a card, a new module and one name here."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["FAMILIES", "by_architecture"]

FAMILIES = ("bert", "deepseek", "gemma", "gpt2", "gpt_neox", "llama", "mixtral", "olmo2", "phi3",
            "qwen", "t5")


def by_architecture() -> dict[str, ModuleType]:
    """Architecture name (config.json "architectures") -> its family module."""
    modules = [importlib.import_module(f"tfx.hf.{name}") for name in FAMILIES]
    return {arch: module for module in modules for arch in module.ARCHITECTURES}
