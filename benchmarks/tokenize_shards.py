"""Tokenizing a corpus: `tfx.train.shard_writer.tokenize_to_shards` vs `datasets.Dataset.map`
with the same `tokenizers` tokenizer, on the same texts in the same run.

    python benchmarks/tokenize_shards.py                   # 5 alternating repeats
    python benchmarks/tokenize_shards.py --quick           # 2 repeats: a smoke run
    python benchmarks/tokenize_shards.py --tokenizer PATH  # a tokenizer.json instead of the BPE
    python benchmarks/tokenize_shards.py --json benchmarks/results/tokenize_shards.json

(Not benchmarks/tokenize.py: a script of that name shadows the standard library's `tokenize`
module, which numpy's imports load, so the script would run twice and break tracebacks.)

The corpus is the embedded one (`tfx.train.data.stdlib_texts()`, about 8 MB of Python in some
500 files); the tokenizer a byte-level BPE of 8192 ids trained on it here (or --tokenizer).
- tfx: `tokenize_to_shards([corpus.jsonl], ...)`, the texts written once as JSONL: reading and
  parsing that file, encoding (`encode_batch_fast`), and writing uint16 shards, document
  starts and checksums to disk (fsync'd), then the manifest.
- datasets.map: `Dataset.from_dict({"text": texts})` (already in memory), then
  `.map(encode, batched=True)` with `encode_batch` (the usual recipe) and, to separate the two
  effects, `encode_batch_fast`; caching off, results kept in Arrow memory, nothing on disk.
The peers start from memory and write nothing, so the ratio is conservative for tfx. Reported:
median wall and CPU seconds over --repeats runs (the order alternating), tokens/s, and the
peer's time over tfx's (> 1: tfx is faster). `tfx (byte)`: the byte tokenizer, for reference.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import tokenizers
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish
from tokenizers import decoders, models, pre_tokenizers, trainers

from tfx.train.data import ByteTokenizer, HFTokenizer, stdlib_texts
from tfx.train.shard_writer import tokenize_to_shards

VOCAB = 8192


def train_bpe(texts: list[str], folder: pathlib.Path) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style) of VOCAB ids trained on `texts`, saved in `folder`."""
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder)


def runners(texts: list[str], jsonl: pathlib.Path, tokenizer: HFTokenizer,
            work: pathlib.Path) -> dict:
    """{name: run() -> tokens produced}, each a whole tokenization of the corpus."""
    import datasets

    datasets.disable_caching()
    datasets.disable_progress_bars()
    inner = tokenizers.Tokenizer.from_file(str(tokenizer.path))

    def tfx(tok):
        def run() -> int:
            manifest = tokenize_to_shards([jsonl], tok, work / "shards", progress=False)
            return sum(s["tokens"] for s in manifest.splits.values())
        return run

    def peer(encode):
        def run() -> int:
            mapped = datasets.Dataset.from_dict({"text": texts}).map(
                lambda rows: {"ids": [e.ids for e in encode(rows["text"],
                                                             add_special_tokens=False)]},
                batched=True, remove_columns=["text"])
            return sum(len(ids) for ids in mapped["ids"])
        return run

    return {"tfx": tfx(tokenizer), "datasets.map (encode_batch)": peer(inner.encode_batch),
            "datasets.map (encode_batch_fast)": peer(inner.encode_batch_fast),
            "tfx (byte)": tfx(ByteTokenizer())}


def measure(args) -> dict:
    texts = [text for _, text in stdlib_texts()]
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        jsonl = work / "corpus.jsonl"
        jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        (work / "bpe").mkdir()
        start = time.perf_counter()
        tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else train_bpe(
            texts, work / "bpe")
        train_s = time.perf_counter() - start
        runs = runners(texts, jsonl, tokenizer, work)
        tokens = {name: run() for name, run in runs.items()}  # warm-up: imports, page cache
        times = {name: ([], []) for name in runs}  # (wall seconds, CPU seconds) per run
        for repeat in range(args.repeats):  # alternate, the order flipping every repeat
            for name in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
                start, cpu = time.perf_counter(), time.process_time()
                runs[name]()
                times[name][0].append(time.perf_counter() - start)
                times[name][1].append(time.process_time() - cpu)
    results = {}
    for name, (wall, cpu) in times.items():
        median, cpu_median = statistics.median(wall), statistics.median(cpu)
        results[name] = {
            "seconds": median, "seconds_all": wall, "cpu_s": cpu_median, "cpu_s_all": cpu,
            "tokens": tokens[name], "tokens_per_s": tokens[name] / median,
            "peer_over_tfx": None if name.startswith("tfx") else
            median / statistics.median(times["tfx"][0]),
            "peer_over_tfx_cpu": None if name.startswith("tfx") else
            cpu_median / statistics.median(times["tfx"][1])}
    return {"corpus_bytes": sum(len(t.encode()) for t in texts), "documents": len(texts),
            "tokenizer": str(args.tokenizer or f"byte-level BPE, {VOCAB} ids, trained here"),
            "tokenizer_train_s": None if args.tokenizer else train_s, "runs": results}


def render(results: dict) -> str:
    m = results["measured"]
    return "\n".join([
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); {results['cpus']} CPUs, tokenizers {results['tokenizers']}, "
        f"datasets {results['datasets']}.",
        "",
        f"## Tokenizing {m['documents']} documents ({m['corpus_bytes'] / 2**20:.1f} MiB): "
        f"{m['tokenizer']}",
        "",
        f"Medians of {results['repeats']} alternating runs after one warm-up run. "
        "peer / tfx: the peer's seconds over tfx's (> 1: tfx is faster). tfx reads a JSONL file "
        "and writes shards to disk; the peers start from memory and write nothing. CPU s: "
        "the process's CPU time (all threads), steadier than wall time on a shared machine.",
        "",
        markdown_table(["run", "seconds", "CPU s", "tokens", "tokens/s", "peer / tfx",
                        "peer / tfx (CPU)"],
                       [[name, r["seconds"], r["cpu_s"], r["tokens"], r["tokens_per_s"],
                         _ratio(r["peer_over_tfx"]), _ratio(r["peer_over_tfx_cpu"])]
                        for name, r in m["runs"].items()]),
    ]) + "\n"


def _ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def main() -> None:
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repeats")
    parser.add_argument("--tokenizer", help="a tokenizer.json (or its folder) instead of the BPE")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 2
    results = {**provenance("tokenize_shards.py"), "tokenizers": tokenizers.__version__,
               "datasets": datasets.__version__, "repeats": args.repeats}
    results["measured"] = measure(args)
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
