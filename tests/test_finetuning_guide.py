"""docs/finetuning.md runs as written: its ```bash blocks in order, then its ```python blocks, in a
fresh folder (holding a link to experiments/) with the `tfx` console script of this Python on
the PATH, as a new user would type them. The guide's path needs transformers, torch and peft
(the parity extra), lm-eval (the eval extra) and qwix is not needed."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

for _name in ("torch", "transformers", "peft", "lm_eval"):
    pytest.importorskip(_name)

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "finetuning.md"
TIMEOUT_S = 900  # about 3-5 minutes on 2 busy cores: each command starts jax and compiles


def blocks(kind: str) -> list[str]:
    """The ```kind blocks of the guide, in order."""
    return re.findall(rf"^```{kind}\n(.*?)^```$", GUIDE.read_text(encoding="utf-8"), re.S | re.M)


def test_the_guide_has_the_whole_path():
    commands = "\n".join(blocks("bash"))
    for step in ("tiny_chat_model.py", "tfx train sft", "tfx sample", "tfx eval", "--tasks",
                 "tfx export", "PeftModel", "tfx train dpo", "tfx tokenize"):
        assert step in commands


@pytest.mark.slow
def test_every_block_of_the_guide_runs(tmp_path):
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    scripts = pathlib.Path(sys.executable).parent  # where pip put the `tfx` console script
    env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = "set -euo pipefail\n" + "\n".join(blocks("bash"))
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert (tmp_path / "runs" / "sft-adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "sft-merged" / "config.json").is_file()
    # the peft adapter and the merged folder give the same logits in transformers
    differences = re.findall(r"tensor\(([0-9.e-]+)", done.stdout)
    assert differences and float(differences[-1]) < 1e-4, done.stdout[-2000:]
    for code in blocks("python"):
        ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=TIMEOUT_S)
        assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
