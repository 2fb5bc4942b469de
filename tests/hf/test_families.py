"""tfx.hf.families finds the family modules by looking through tfx/hf, so a new family is its card
and its module, with no list to edit."""

from __future__ import annotations

import ast
from pathlib import Path

import tfx.hf
from tfx.hf import peft_adapter
from tfx.hf.families import INTERFACE, by_architecture

HF = Path(tfx.hf.__file__).parent


def _defines_config_from_hf(path: Path) -> bool:
    """Whether a source file defines `config_from_hf` at its top level (read, not imported)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(node, ast.FunctionDef) and node.name == "config_from_hf"
               for node in tree.body)


def test_every_module_that_reads_a_config_json_is_found_and_no_other():
    written = {f"tfx.hf.{path.stem}" for path in HF.glob("*.py") if _defines_config_from_hf(path)}
    found = {module.__name__ for module in by_architecture().values()}
    assert found == written
    assert "tfx.hf.peft_adapter" not in found  # it has ARCHITECTURES too, of adapter writers


def test_each_family_module_defines_the_interface_and_claims_its_own_architectures():
    families = set(by_architecture().values())
    for module in families:
        assert [name for name in INTERFACE if not hasattr(module, name)] == [], module.__name__
    claimed = [arch for module in families for arch in module.ARCHITECTURES]
    assert len(claimed) == len(set(claimed)), "two family modules claim one architecture"


def test_the_supported_architectures_are_the_families_and_cover_the_adapter_writers():
    assert tuple(sorted(by_architecture())) == tfx.hf.SUPPORTED
    assert set(peft_adapter.ARCHITECTURES) <= set(by_architecture())
