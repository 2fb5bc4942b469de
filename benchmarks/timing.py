"""Shared measuring helpers for the benchmark scripts: medians of repeated runs, peak memory,
child processes, and tables printed as markdown."""

from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def median_seconds(run: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `run()` (which must block until its result is ready)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_growth_mib(run: Callable[[], object]) -> float:
    """How far `run()` raises this process's resident memory above where it stood, in MiB.

    Linux only: writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current
    resident set, so earlier peaks (imports, compilation) do not hide the run's own.
    """
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_child(args: Sequence[str]) -> dict:
    """Run `python args...` and parse the JSON object it prints last."""
    done = subprocess.run([sys.executable, *args], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value):
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {path}")


def add_output_arguments(parser) -> None:
    """--json PATH and --markdown PATH (default with --json: the same path ending in .md)."""
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--markdown",
                        help="write the report to this path (default with --json: its .md)")


def decoding_arguments(description: str, *, repeats: int) -> tuple[int, int, object]:
    """Parse a decoding benchmark's command line: --new-tokens (64), --repeats, --quick (8 new
    tokens, 1 repeat: a smoke run) and the output arguments. Returns (new_tokens, repeats,
    args)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    return (8, 1, args) if args.quick else (args.new_tokens, args.repeats, args)


def markdown_path(args) -> str | None:
    """Where `add_output_arguments`' report goes: --markdown, else --json's path as .md."""
    return args.markdown or (args.json and args.json.removesuffix(".json") + ".md")


def publish(report: str, results: dict, *, json_path: str | None,
            markdown_path: str | None) -> None:
    """Print the markdown report and write the results JSON and the report where asked."""
    print("\n" + report)
    write_json(json_path, results)
    if markdown_path:
        pathlib.Path(markdown_path).write_text(report)


def provenance(script: str) -> dict:
    """Where a result comes from: the command, git revision, date, library versions (torch and
    transformers when installed), CPU count and XLA_FLAGS."""
    import os

    import jax

    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
    versions = {"jax": jax.__version__}
    for name in ("torch", "transformers"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return {"command": " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
            "revision": revision or "unknown", "date": time.strftime("%Y-%m-%d"), **versions,
            "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
