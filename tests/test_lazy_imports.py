"""`import tfx` is quick and loads its subpackages on first use (PEP 562)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tfx


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True).stdout


def test_import_tfx_imports_no_jax_and_exposes_every_subpackage():
    out = _run("import sys, tfx; print(sorted(m for m in sys.modules if m.startswith('jax')));"
               "print(tfx.hf.load.__module__, tfx.generate.__name__, tfx.train.get_experiment)")
    first, second = out.splitlines()
    assert first == "[]"
    assert second.startswith("tfx.hf") and " generate " in second


def test_dir_lists_the_lazy_names_and_unknown_names_raise():
    for name in ("ops", "nn", "models", "hf", "peft", "parallel", "train", "generate",
                 "beam_search"):
        assert name in dir(tfx)
    assert tfx.models.Decoder.__name__ == "Decoder" and "Decoder" in dir(tfx.models)
    assert tfx.train.Experiment.__module__ == "tfx.train.config"
    with pytest.raises(AttributeError, match="'tfx' has no attribute 'nope'"):
        getattr(tfx, "nope")  # noqa: B009 (the lookup is the test)


def test_the_config_modules_import_without_jax():
    modules = ("tfx.models.config", "tfx.models.parts", "tfx.models.presets",
               "tfx.train.config", "tfx.train.experiments", "tfx.train.overrides",
               "tfx.train.migration", "tfx.cli.commands")
    out = _run(f"import sys\nfor m in {modules!r}: __import__(m)\n"
               "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    assert out.strip() == "[]"


def test_every_public_submodule_is_an_attribute_of_its_lazy_package():
    # tfx.ops.moe was missing until imported by name: a package's submodules need no entry.
    out = _run("import tfx\nprint(tfx.ops.moe.__name__, tfx.ops.attention.paged.__name__,"
               "'moe' in dir(tfx.ops), 'generation' in dir(tfx), tfx.generation.__name__)")
    assert out.split() == ["tfx.ops.moe", "tfx.ops.attention.paged", "True", "True",
                           "tfx.generation"]
