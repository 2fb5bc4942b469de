"""Runs a script of experiments/ in --smoke mode into a temporary folder (tests/experiments),
and checks what every script publishes: NAME.md and NAME.png, and NAME.json holding the exact
command and the same results that --json wrote and main returned."""

from __future__ import annotations

import importlib
import json
from pathlib import Path


def smoke_run(name: str, tmp_path: Path) -> tuple[dict, Path]:
    """Run experiments/NAME.py --smoke; returns (the --json results, the results folder)."""
    script = importlib.import_module(name)  # experiments/ is on pytest's pythonpath
    out, folder = tmp_path / "results.json", tmp_path / "results"
    returned = script.main(["--smoke", "--json", str(out), "--workdir", str(tmp_path / "runs"),
                            "--out", str(folder)])
    results = json.loads(out.read_text())
    assert json.loads(json.dumps(returned)) == results
    published = json.loads((folder / f"{name}.json").read_text())
    assert published["command"].startswith(f"python experiments/{name}.py --smoke")
    assert published["revision"]
    assert published["results"] == results
    for suffix in ("md", "png"):
        assert (folder / f"{name}.{suffix}").stat().st_size > 0
    return results, folder
