"""Packed vs padded training rows: how much of a row is real text, and real-text tokens/s of the
training step, for the default experiment (gpt_char: the char-gpt preset, batch 16 x 128).

    python benchmarks/packing.py                      # 7 repeats
    python benchmarks/packing.py --quick              # 2 repeats: a smoke run
    python benchmarks/packing.py --json benchmarks/results/packing.json   # also writes .md

Documents are the training side of the default corpus (`tfx.train.packed_feed.load_documents`:
the standard library's files), and, as a corpus of short documents, the non-empty lines of
those files (what `data.source` = one text file gives). Each is laid out two ways in rows of
seq_len + 1 tokens:
- packed: `tfx.train.packing.pack` (best-fit decreasing, several documents per row);
- padded: each document in rows of its own (a long one cut into row-length pieces), padding
  after it: `tfx.train.packing.lay_out` with one piece per row.
Both train with `tfx.train.packed_losses.packed_causal_lm` (segment ids keep padding and other
documents out), on the real training path (make_optimizer, init_train_state, make_train_step).
"windows" is today's unpacked feed for reference: windows cut across documents, `causal_lm`
without segment ids (every token counts as text, but contexts span file boundaries).

Efficiency = document tokens / row tokens, over all rows. Real tokens/s = the batches' real
input tokens (segment > 0) / the median step time; steps alternate between the layouts, each
on its own batches (rows drawn as the feed draws them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

from tfx.models import create
from tfx.train.data import ByteTokenizer, load_corpus
from tfx.train.experiments import get_experiment
from tfx.train.optim import make_optimizer
from tfx.train.packed_feed import load_documents
from tfx.train.packed_losses import packed_causal_lm
from tfx.train.packing import Packed, lay_out, pack
from tfx.train.step import init_train_state, make_train_step


def padded(documents: list[np.ndarray], row_len: int) -> Packed:
    """Each document alone in its rows: pieces of row_len tokens, one piece per row."""
    pieces = [d[i:i + row_len] for d in documents for i in range(0, len(d), row_len)]
    return lay_out(pieces, np.arange(len(pieces)), row_len)


def layouts(row_len: int) -> dict[str, tuple[Packed, float]]:
    """{name: (rows, seconds to build them)} for packed and padded files and lines."""
    train, _ = load_documents(None, ByteTokenizer())
    lines = [d[s:e] for d in train for s, e in _line_spans(d) if e > s]
    out = {}
    for corpus, documents in (("files", train), ("lines", lines)):
        for kind, build in (("packed", pack), ("padded", padded)):
            start = time.perf_counter()
            rows = build(documents, row_len)
            out[f"{kind} {corpus}"] = (rows, time.perf_counter() - start)
    return out


def _line_spans(tokens: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each line of a byte document (newlines left out)."""
    breaks = np.flatnonzero(tokens == ord("\n"))
    starts = np.r_[0, breaks + 1]
    ends = np.r_[breaks, len(tokens)]
    return [(s, e) for s, e in zip(starts, ends, strict=True)
            if bytes(tokens[s:e].astype(np.uint8)).strip()]


def batches(rows: Packed, count: int, batch: int) -> list[dict]:
    """`count` batches of rows drawn as PackedTextFeed draws them (default_rng([0, step]))."""
    out = []
    for step in range(count):
        picked = np.random.default_rng([0, step]).integers(0, len(rows.tokens), batch)
        out.append({"tokens": rows.tokens[picked].astype(np.int32),
                    "segment_ids": rows.segment_ids[picked].astype(np.int32),
                    "positions": rows.positions[picked].astype(np.int32)})
    return out


def runner(config, loss, data: list[dict], steps: int):
    """step() -> None running the next batch of `data` through a fresh training state."""
    optimizer = make_optimizer(get_experiment().optim, steps)
    graphdef, rest, state = init_train_state(create(config, rngs=nnx.Rngs(0)), optimizer,
                                             seed=0)
    train_step = make_train_step(graphdef, rest, optimizer, loss)
    box, device = [state, 0], [jax.device_put(b) for b in data]

    def step() -> None:
        box[0], metrics = train_step(box[0], device[box[1] % len(device)])
        box[1] += 1
        jax.block_until_ready(metrics["loss"])

    return step


def measure(args) -> dict:
    from tfx.train.losses import causal_lm

    experiment = get_experiment()
    t = experiment.train
    built = layouts(t.seq_len + 1)
    stream, _ = load_corpus(None, ByteTokenizer())
    count = args.warmup + args.repeats + 1
    windows = [{"tokens": stream.batch(s, t.batch_size, t.seq_len, seed=0)} for s in range(count)]
    runs = {"windows": (windows, causal_lm)}
    runs.update({name: (batches(rows, count, t.batch_size), packed_causal_lm)
                 for name, (rows, _) in built.items()})
    steps = {name: runner(experiment.model, loss, data, count) for name, (data, loss)
             in runs.items()}
    for step in steps.values():  # compile and warm up
        for _ in range(1 + args.warmup):
            step()
    times = {name: [] for name in steps}
    for repeat in range(args.repeats):  # alternate, the order flipping every repeat
        for name in (list(steps) if repeat % 2 == 0 else list(steps)[::-1]):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    results = {}
    for name, (data, _) in runs.items():
        real = np.mean([(b["segment_ids"][:, :-1] > 0).sum() if "segment_ids" in b
                        else b["tokens"][:, :-1].size for b in data])
        median = statistics.median(times[name])
        rows = built[name][0] if name in built else None
        results[name] = {
            "efficiency": 1.0 if rows is None else rows.efficiency,
            "rows": None if rows is None else len(rows.tokens),
            "build_s": None if rows is None else built[name][1],
            "step_s": median, "step_s_all": times[name],
            "real_tokens_per_batch": float(real), "real_tokens_per_s": float(real / median)}
    return results


def render(results: dict) -> str:
    rows = results["layouts"]
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs.",
        "",
        f"## Packed vs padded rows: gpt_char (char-gpt), batch {results['batch']} x "
        f"{results['seq_len']}, float32",
        "",
        f"Medians of {results['repeats']} alternating training steps after "
        f"{results['warmup']} warmup step(s). Efficiency: document tokens / row tokens over all "
        "rows. Real tokens/s: real input tokens of the batches / median step time. "
        "windows: today's unpacked feed (windows across documents, no segment ids).",
        "",
        markdown_table(
            ["layout", "rows", "efficiency", "build s", "step s", "real tokens/batch",
             "real tokens/s", "vs padded"],
            [[name, r["rows"], f"{r['efficiency']:.1%}", r["build_s"], r["step_s"],
              r["real_tokens_per_batch"], r["real_tokens_per_s"],
              _ratio(rows, name)] for name, r in rows.items()]),
    ]
    return "\n".join(lines) + "\n"


def _ratio(rows: dict, name: str) -> str | None:
    """Real tokens/s of a packed layout over its padded peer."""
    if not name.startswith("packed"):
        return None
    peer = rows[name.replace("packed", "padded")]
    return f"{rows[name]['real_tokens_per_s'] / peer['real_tokens_per_s']:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1 warmup step, 2 repeats")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.repeats = 1, 2
    t = get_experiment().train
    results = {**provenance("packing.py"), "batch": t.batch_size, "seq_len": t.seq_len,
               "warmup": args.warmup, "repeats": args.repeats, "layouts": measure(args)}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
