"""Every ```python block of README.md and of the guides in docs/ runs as written, in order.

Each file's blocks run one after another in one namespace of their own, as a reader pasting that
file's blocks into one session would: a block sees the names the blocks above it in the same
file defined, and nothing of another file (a guide that needs a model makes its own). One fresh
interpreter runs them all, file after file (a timeout bounds it), and each block is reported by
its own test, `test_guide_block[docs/generation.md:N]`, with N the block's first line in that
file; a failing block's traceback points at the file and line. docs/finetuning.md, whose blocks
run the `tfx` command on the files its earlier steps made, runs in
tests/test_finetuning_guide.py.

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

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Guides whose blocks another test runs, as they need more than a Python session.
OWN_TESTS = {"finetuning.md": "tests/test_finetuning_guide.py"}
GUIDES = [README] + [path for path in sorted((ROOT / "docs").glob("*.md"))
                     if path.name not in OWN_TESTS]
TIMEOUT_S = 420  # all the files' blocks take about a minute on 2 busy CPU cores
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*(.+)")

# Runs in the subprocess: execute each block, recording its outcome as it goes, so that a
# timeout still shows which block was running.
DRIVER = r"""
import importlib.util, json, sys, time, traceback
files, out = json.load(open(sys.argv[1])), sys.argv[2]
results = {}
def record(key, outcome, detail=""):
    results[key] = {"outcome": outcome, "detail": detail}
    json.dump(results, open(out, "w"))
for source, blocks in files.items():
    namespace = {"__name__": "__main__"}   # each file starts afresh
    for block in blocks:
        line, key = block["line"], f"{block['file']}:{block['line']}"
        missing = [name for name in block["needs"] if importlib.util.find_spec(name) is None]
        if missing:
            record(key, "skipped", "needs " + ", ".join(missing))
            continue
        record(key, "running")
        start = time.perf_counter()
        try:
            # Blank lines in front keep the file's line numbers in tracebacks.
            code = compile("\n" * (line - 1) + block["code"], source, "exec")
            exec(code, namespace)
        except BaseException:
            record(key, "failed", traceback.format_exc())
        else:
            record(key, "passed", f"{time.perf_counter() - start:.1f} s")
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


def relative(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


TEXTS = {relative(path): path.read_text(encoding="utf-8") for path in GUIDES}
BLOCKS = [{"file": name, **block} for name, text in TEXTS.items() for block in python_blocks(text)]


def block_id(block: dict) -> str:
    return f"{block['file']}:{block['line']}"


@pytest.mark.parametrize("name", list(TEXTS))
def test_every_python_fence_is_extracted(name):
    text = TEXTS[name]
    opened = len(re.findall(r"^```python\s*$", text, re.M))
    if name == "README.md":
        assert opened > 0, "README.md has no ```python block"
    found = [block for block in BLOCKS if block["file"] == name]
    assert len(found) == opened, f"{name}: a ```python fence is not closed by a ``` line of its own"
    for block in found:
        for needed in block["needs"]:
            assert needed.isidentifier() or all(p.isidentifier() for p in needed.split(".")), (
                f"{block_id(block)}: `# needs:` takes import names, got {needed!r}")


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    """Run the blocks of every file that a selected test names, in one fresh interpreter, each
    file in a fresh namespace of its own (cwd: a temporary folder holding a link to the
    repository's experiments/, as the blocks run from the repository's root); return the
    outcome per `FILE:LINE` and how the interpreter ended. One interpreter, not one per file:
    each would import jax and compile the same small models again."""
    selected = {item.callspec.params["block"]["file"] for item in request.session.items
                if item.originalname == "test_guide_block"}
    files = {str(ROOT / name): [b for b in BLOCKS if b["file"] == name]
             for name in TEXTS if name in selected}
    folder = tmp_path_factory.mktemp("guides")
    (folder / "experiments").symlink_to(ROOT / "experiments")
    blocks, results = folder / "blocks.json", folder / "results.json"
    blocks.write_text(json.dumps(files))
    env = dict(os.environ, MPLBACKEND="Agg")
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER, str(blocks), str(results)],
                              cwd=folder, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        ended = f"exit status {done.returncode}; stderr tail:\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        ended = f"timed out after {TIMEOUT_S} s"
    found = json.loads(results.read_text()) if results.exists() else {}
    return {"results": found, "ended": ended}


@pytest.mark.parametrize("block", BLOCKS, ids=[block_id(b) for b in BLOCKS])
def test_guide_block(block, outcomes):
    ran, where = outcomes, block_id(block)
    result = ran["results"].get(where)
    if result is None:
        pytest.fail(f"{where}: never reached ({ran['ended']})")
    if result["outcome"] == "skipped":
        pytest.skip(f"{where}: {result['detail']}")
    if result["outcome"] == "running":
        pytest.fail(f"{where}: did not finish ({ran['ended']})")
    assert result["outcome"] == "passed", f"{where} raised:\n{result['detail']}"


# ```bash blocks that run a Python script given on standard input (`python - <<'EOF'`), with
# the environment their first line sets (e.g. 8 simulated devices for a mesh), as written.
SCRIPTS = [{"file": name, "line": text.count("\n", 0, match.start(1)) + 1, "code": match.group(1)}
           for name, text in TEXTS.items()
           for match in re.finditer(r"^```bash\n(.*?)^```[ \t]*$", text, re.S | re.M)
           if "python - <<'EOF'" in match.group(1)]


@pytest.mark.parametrize("script", SCRIPTS, ids=[block_id(s) for s in SCRIPTS])
def test_guide_bash_script(script, tmp_path):
    done = subprocess.run(["bash", "-e", "-c", script["code"]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{block_id(script)}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{block_id(script)}:\n{done.stderr[-3000:]}"


def test_every_guide_is_on_the_map():
    """The README links every guide in docs/ (as GitHub resolves it) and the site's nav lists it:
    a new guide cannot go missing from either."""
    readme, nav = TEXTS["README.md"], (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path.name == "index.md":
            continue
        assert f"](docs/{path.name})" in readme, f"README.md links no docs/{path.name}"
        assert re.search(rf":\s*{re.escape(path.name)}\s*$", nav, re.M), (
            f"mkdocs.yml's nav lists no {path.name}")
