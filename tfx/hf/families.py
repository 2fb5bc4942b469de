"""The family modules of `tfx.hf`, found by looking: each maps the config.json and tensors of the
Hugging Face architectures it lists (`ARCHITECTURES`) onto a tfx model and back, through the
names of `INTERFACE`. What a family is lives in its card (`tfx.models.families`); its module
reads the card and the sizes of config.json. A new family is a card and a module
(`tfx/hf/<family>.py`): `by_architecture` finds every module of this package that defines
`config_from_hf`, so no list names the families."""

from __future__ import annotations

import functools
import importlib
import pathlib
import pkgutil
from types import ModuleType

__all__ = ["INTERFACE", "by_architecture"]

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
