"""The experiments guide (docs/experiments.md) quotes only measured numbers: every decimal number
in the paragraph of an experiment (the text that links experiments/results/NAME.md), and every
whole number written with thousands separators (2,503), is one of the numbers in the committed
experiments/results/NAME.json, rounded as written (a percentage as 100 x the number). A
result that is rerun and changes then fails here until the guide follows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "experiments" / "results"
NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(%?)")
LINK = re.compile(r"experiments/results/(\w+)\.md")


GUIDE = ROOT / "docs" / "experiments.md"


def experiments_section() -> str:
    """The guide, which holds nothing but the experiments."""
    text = GUIDE.read_text()
    assert text.startswith("# Experiments\n"), f"{GUIDE} is no longer the experiments guide"
    return text


def paragraphs() -> list[tuple[str, str]]:
    """(results name, paragraph) for every paragraph of the section that links one result."""
    found = []
    for paragraph in experiments_section().split("\n\n"):
        names = set(LINK.findall(paragraph))
        if len(names) == 1:
            found.append((names.pop(), paragraph))
    return found


def numbers_in(tree) -> list[float]:
    """Every number in a JSON tree, numeric keys ({"1.25": ...}: capacity factors) included."""
    if isinstance(tree, dict):
        keys = [float(k) for k in tree if re.fullmatch(r"\d+(\.\d+)?", k)]
        return keys + [x for value in tree.values() for x in numbers_in(value)]
    if isinstance(tree, list):
        return [x for value in tree for x in numbers_in(value)]
    return [float(tree)] if isinstance(tree, int | float) and not isinstance(tree, bool) else []


def test_every_published_result_is_quoted():
    quoted = {name for name, _ in paragraphs()}
    published = {path.stem for path in RESULTS.glob("*.json")}
    missing = published - quoted
    assert not missing, f"results without a paragraph in docs/experiments.md: {missing}"


@pytest.mark.parametrize(("name", "paragraph"), paragraphs(), ids=lambda x: x[:30])
def test_quoted_numbers_are_in_the_results(name, paragraph):
    measured = numbers_in(json.loads((RESULTS / f"{name}.json").read_text())["results"])
    for text, percent in NUMBER.findall(paragraph):
        decimals = len(text.split(".")[1]) if "." in text else 0
        value = float(text.replace(",", "")) / (100 if percent else 1)
        tolerance = 0.5 * 10 ** -decimals / (100 if percent else 1) + 1e-12
        assert any(abs(m - value) <= tolerance for m in measured), (
            f"{text}{percent} in docs/experiments.md's {name} paragraph is not in {name}.json")
