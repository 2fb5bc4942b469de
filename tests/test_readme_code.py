"""Every ```python block of README.md runs as written, in order, in one fresh interpreter.

The blocks run one after another in one namespace, as a reader pasting them into one session
would: a block sees the names the blocks above it defined. One subprocess runs them all (a
timeout bounds it), and each block is reported by its own test, `test_readme_block[line-N]`,
with N the block's first line in README.md; a failing block's traceback points at README.md.

A block runs unless its first line is a marker naming the optional packages it needs, by their
import names: `# needs: transformers, torch`. Such a block is skipped, with a reason naming the
missing package that `pytest -ra` lists, only when one of them cannot be imported; the blocks
after it still run (a later block that needs its names then fails, loudly). No other way to
skip exists.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 420  # the blocks take about a minute on 2 busy CPU cores
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*(.+)")

# Runs in the subprocess: execute each block, recording its outcome as it goes, so that a
# timeout still shows which block was running.
DRIVER = r"""
import importlib.util, json, sys, time, traceback
blocks, readme, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
namespace, results = {"__name__": "__main__"}, {}
def record(line, outcome, detail=""):
    results[str(line)] = {"outcome": outcome, "detail": detail}
    json.dump(results, open(out, "w"))
for block in blocks:
    line = block["line"]
    missing = [name for name in block["needs"] if importlib.util.find_spec(name) is None]
    if missing:
        record(line, "skipped", "needs " + ", ".join(missing))
        continue
    record(line, "running")
    start = time.perf_counter()
    try:
        # Blank lines in front keep README.md's line numbers in tracebacks.
        code = compile("\n" * (line - 1) + block["code"], readme, "exec")
        exec(code, namespace)
    except BaseException:
        record(line, "failed", traceback.format_exc())
    else:
        record(line, "passed", f"{time.perf_counter() - start:.1f} s")
"""


def python_blocks(text: str) -> list[dict]:
    """The ```python blocks of `text`, in order: {"line": first code line (1-based), "code",
    "needs": import names from a first-line `# needs:` marker}."""
    blocks = []
    for match in FENCE.finditer(text):
        code = match.group(1)
        first = code.split("\n", 1)[0].strip()
        marker = NEEDS.fullmatch(first)
        needs = [name.strip() for name in marker.group(1).split(",")] if marker else []
        line = text.count("\n", 0, match.start(1)) + 1
        blocks.append({"line": line, "code": code, "needs": needs})
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_every_python_fence_is_extracted():
    opened = len(re.findall(r"^```python\s*$", README.read_text(encoding="utf-8"), re.M))
    assert opened > 0, "README.md has no ```python block"
    assert len(BLOCKS) == opened, "a ```python fence is not closed by a ``` line of its own"
    for block in BLOCKS:
        for name in block["needs"]:
            assert name.isidentifier() or all(p.isidentifier() for p in name.split(".")), (
                f"README.md:{block['line']}: `# needs:` takes import names, got {name!r}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Run every block in one fresh interpreter (cwd: a temporary folder holding a link to the
    repository's experiments/, as the README's blocks run from the repository's root) and
    return the outcome per first line."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "experiments").symlink_to(README.parent / "experiments")
    blocks, results = folder / "blocks.json", folder / "results.json"
    blocks.write_text(json.dumps(BLOCKS))
    env = dict(os.environ, MPLBACKEND="Agg")
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER, str(blocks), str(README),
                               str(results)], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        ended = f"exit status {done.returncode}; stderr tail:\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        ended = f"timed out after {TIMEOUT_S} s"
    found = json.loads(results.read_text()) if results.exists() else {}
    return {"results": found, "ended": ended}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line-{b['line']}" for b in BLOCKS])
def test_readme_block(block, outcomes):
    result = outcomes["results"].get(str(block["line"]))
    where = f"README.md:{block['line']}"
    if result is None:
        pytest.fail(f"{where}: never reached ({outcomes['ended']})")
    if result["outcome"] == "skipped":
        pytest.skip(f"{where}: {result['detail']}")
    if result["outcome"] == "running":
        pytest.fail(f"{where}: did not finish ({outcomes['ended']})")
    assert result["outcome"] == "passed", f"{where} raised:\n{result['detail']}"


# ```bash blocks that run a Python script given on standard input (`python - <<'EOF'`), with
# the environment their first line sets (e.g. 8 simulated devices for a mesh), as written.
SCRIPTS = [match.group(1) for match in re.finditer(r"^```bash\n(.*?)^```[ \t]*$",
                                                  README.read_text(encoding="utf-8"), re.S | re.M)
           if "python - <<'EOF'" in match.group(1)]


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"script-{i}" for i in range(len(SCRIPTS))])
def test_readme_bash_script(script, tmp_path):
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
