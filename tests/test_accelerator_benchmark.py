"""benchmarks/accelerator.sh --quick runs on CPU (tiny shapes) and fills every row of its table:
the same code a rented accelerator runs at full size."""

import json
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_accelerator_benchmark_quick_run(tmp_path):
    out = tmp_path / "accelerator.json"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert {row["benchmark"] for row in rows} == {"matmul", "attention", "moe", "decode", "train"}
    assert not [row for row in rows if "error" in row]
    timed = [row for row in rows if row["benchmark"] != "matmul"]
    assert all(row["ms"] > 0 and row["tflops"] > 0 for row in timed)
    # 1 length x {full, causal} x {fwd, fwd+bwd} x {tfx, jax.nn}
    assert sum(row["benchmark"] == "attention" for row in rows) == 8
    assert results["environment"]["platform"] == "cpu"
    assert "| benchmark | case |" in done.stdout
