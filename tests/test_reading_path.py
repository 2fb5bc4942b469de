"""The reading path of a forward pass (issue 43): the tfx files that one LLaMA forward enters.

A reader following `model(input_ids)` through the code opens every file the call enters, so
that number is kept from growing back silently: the profile below records each Python call made
while a tiny LLaMA traces its forward at a new input shape, and the test fails, listing the
files with the functions called in each, when it enters more than MAX_FILES of them.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import jax
import jax.numpy as jnp

import tfx
from tfx.models import create

# The files one forward enters today (issue 43 asks for 12): lower it as the path shortens.
MAX_FILES = 20
PACKAGE = pathlib.Path(tfx.__file__).resolve().parent


def _files_entered(model, input_ids: jax.Array) -> dict[str, set[str]]:
    """tfx file (relative to the package) -> the functions of it that `model(input_ids)` calls.

    jax's caches are cleared first, so the jitted ops trace again and their Python runs."""
    jax.clear_caches()
    entered = collections.defaultdict(set)

    def record(frame, event, arg):
        if event == "call":
            path = pathlib.Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE):
                entered[path.relative_to(PACKAGE).as_posix()].add(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        model(input_ids)
    finally:
        sys.setprofile(None)
    return dict(entered)


def _report(entered: dict[str, set[str]]) -> str:
    lines = [f"{path} ({sum(1 for _ in (PACKAGE / path).open())} lines): "
             f"{', '.join(sorted(names))}" for path, names in sorted(entered.items())]
    return "\n".join(lines)


def test_a_llama_forward_enters_few_files():
    model = create("llama-tiny")
    model(jnp.ones((1, 8), jnp.int32))  # the first call builds what later calls reuse
    entered = _files_entered(model, jnp.ones((3, 13), jnp.int32))
    # The profile must see the path at all: the attention op is on it.
    assert "ops/attention/dispatch.py" in entered, _report(entered)
    assert len(entered) <= MAX_FILES, (
        f"a LLaMA forward enters {len(entered)} tfx files, more than {MAX_FILES}:\n"
        + _report(entered))
