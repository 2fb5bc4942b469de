"""Loading a Hugging Face checkpoint: `tfx.hf.load` vs transformers' `from_pretrained`, on the
same folder in the same run.

    python benchmarks/load.py                         # a 310M LLaMA in a temporary folder
    python benchmarks/load.py --folder /tmp/llama310  # kept there (written if missing)
    python benchmarks/load.py --json benchmarks/results/load.json   # also writes load.md

The checkpoint: a LlamaForCausalLM (width 1024, 19 layers, MLP 2816, 16 heads, vocabulary
32000: 309.6M parameters, 1.24 GB of float32) with random weights, written once by
transformers' `save_pretrained` (one model.safetensors); it is only data.

Each measurement is a fresh Python process that imports its library, loads the folder
(`tfx.hf.load(folder)`; `AutoModelForCausalLM.from_pretrained(folder)`, float32 both) and runs
one forward call on 16 tokens, logits fetched to numpy: `--repeats` processes per library,
alternating (the order flips every repeat). Reported: medians of the load+call seconds
(after the imports; import seconds apart) and of the peak resident memory of the process
(`ru_maxrss`, imports included), as a multiple of the checkpoint's bytes. Goals for tfx:
peak RSS <= 1.3x the checkpoint, load+call time <= 1.0x transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

from timing import (
    add_output_arguments,
    markdown_path,
    markdown_table,
    provenance,
    publish,
    run_child,
)

LIBRARIES = ("tfx", "transformers")
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=19,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
TOKENS = 16


def write_checkpoint(folder: pathlib.Path) -> dict:
    """The LLaMA of CONFIG with random weights, by transformers' save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(folder, max_shard_size="50GB")
    return {"parameters": model.num_parameters()}


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: now, VmHWM: peak)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(library: str, folder: str) -> dict:
    """Import `library`, load `folder`, run one call: seconds of each, and resident memory
    after the imports, at the peak of the load, and at the peak of all."""
    start = time.perf_counter()
    if library == "tfx":
        import jax.numpy as jnp
        import numpy as np

        import tfx.hf

        jnp.zeros(()).block_until_ready()  # the backend started: part of the imports
        imported, imports_rss = time.perf_counter(), _status_bytes("VmRSS")
        model = tfx.hf.load(folder)
        loaded, load_peak = time.perf_counter(), _status_bytes("VmHWM")
        logits = np.asarray(model(jnp.arange(TOKENS)[None] * 7))
    else:
        import torch
        import transformers

        imported, imports_rss = time.perf_counter(), _status_bytes("VmRSS")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        loaded, load_peak = time.perf_counter(), _status_bytes("VmHWM")
        with torch.no_grad():
            logits = model(torch.arange(TOKENS)[None] * 7).logits.numpy()
    done = time.perf_counter()
    return {"import_s": imported - start, "load_s": loaded - imported, "call_s": done - loaded,
            "load_call_s": done - imported, "logits_shape": list(logits.shape),
            "imports_rss_bytes": imports_rss, "load_peak_rss_bytes": load_peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(folder: pathlib.Path, repeats: int) -> dict:
    """{library: {runs: [child results], medians}} over alternating fresh processes."""
    runs = {library: [] for library in LIBRARIES}
    for repeat in range(repeats):
        for library in LIBRARIES if repeat % 2 == 0 else LIBRARIES[::-1]:
            runs[library].append(run_child([__file__, "--child", library, str(folder)]))
            print(library, runs[library][-1], flush=True)
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    out = {"checkpoint_bytes": checkpoint}
    for library, results in runs.items():
        medians = {key: statistics.median(r[key] for r in results)
                   for key in ("import_s", "load_s", "call_s", "load_call_s", "imports_rss_bytes",
                               "load_peak_rss_bytes", "peak_rss_bytes")}
        out[library] = {"runs": results, **medians,
                        "rss_over_checkpoint": medians["peak_rss_bytes"] / checkpoint}
    out["time_ratio"] = out["tfx"]["load_call_s"] / out["transformers"]["load_call_s"]
    return out


def render(results: dict) -> str:
    r = results["measured"]
    gib = r["checkpoint_bytes"] / 2**30
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, torch {results.get('torch')}, "
        f"transformers {results.get('transformers')}, {results['cpus']} CPUs; load average "
        f"(1 min) {results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after.",
        "",
        f"## Load + one call: LLaMA 309.6M, float32 ({r['checkpoint_bytes'] / 1e9:.2f} GB, "
        f"{gib:.2f} GiB, one model.safetensors)",
        "",
        f"Medians of {results['repeats']} fresh processes per library, alternating. load+call:"
        f" seconds from the imports done to the logits of {TOKENS} tokens on the host. Peak "
        "RSS: ru_maxrss of the process (imports included). Goals for tfx: RSS / checkpoint "
        "<= 1.3, time vs transformers <= 1.0.",
        "",
        markdown_table(
            ["library", "load+call s", "load s", "call s", "imports s", "peak RSS GiB",
             "RSS / checkpoint", "time vs transformers"],
            [[library, r[library]["load_call_s"], r[library]["load_s"], r[library]["call_s"],
              r[library]["import_s"], r[library]["peak_rss_bytes"] / 2**30,
              f"{r[library]['rss_over_checkpoint']:.3f}",
              f"{r[library]['load_call_s'] / r['transformers']['load_call_s']:.2f}x"]
             for library in LIBRARIES]),
        "",
        "Where the resident memory goes (MiB, medians): after the imports (interpreter, "
        "library, backend), the peak while loading, the peak of all (the call included); the "
        "checkpoint's tensors are " f"{r['checkpoint_bytes'] / 2**20:.0f} MiB.",
        "",
        markdown_table(
            ["library", "imports", "load peak", "load peak - imports", "peak",
             "peak - load peak (the call)"],
            [[library, r[library]["imports_rss_bytes"] / 2**20,
              r[library]["load_peak_rss_bytes"] / 2**20,
              (r[library]["load_peak_rss_bytes"] - r[library]["imports_rss_bytes"]) / 2**20,
              r[library]["peak_rss_bytes"] / 2**20,
              (r[library]["peak_rss_bytes"] - r[library]["load_peak_rss_bytes"]) / 2**20]
             for library in LIBRARIES]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=pathlib.Path,
                        help="checkpoint folder (written there if it has no config.json)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--write", type=pathlib.Path, help=argparse.SUPPRESS)
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.child or args.write:
        print(json.dumps(child(*args.child) if args.child else write_checkpoint(args.write)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or pathlib.Path(scratch) / "llama"
        if not (folder / "config.json").is_file():  # torch stays out of this process
            run_child([__file__, "--write", str(folder)])
        results = {**provenance("load.py"), "repeats": args.repeats,
                   "load_average_before": os.getloadavg()}
        results["measured"] = measure(folder, args.repeats)
        results["load_average_after"] = os.getloadavg()
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    sys.exit(main())
