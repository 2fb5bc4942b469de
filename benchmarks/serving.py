"""Serving many requests: continuous batching over a paged cache (`tfx.generation.Engine`) vs
static batching with `tfx.generate` vs transformers' `generate`, same prompts, same weights.

    python benchmarks/serving.py                     # 96 prompts, 1-512 new tokens each
    python benchmarks/serving.py --quick             # 16 prompts, 1-64 new tokens: a smoke run
    python benchmarks/serving.py --json benchmarks/results/serving.json

The model is char-gpt's shape (LLaMA-style: width 256, 4 layers, 4 heads, 2 KV heads, vocab 256,
rotary) with max_len 1024 and random weights (throughput does not depend on training), exported
with `tfx.hf.save` and loaded in `transformers.LlamaForCausalLM`. Prompts have 1-256 tokens,
requests 1-512 new tokens (uniform, fixed seed), no EOS, so every request produces exactly its
max_new_tokens. Useful tokens/s = the sum of the requests' new tokens / wall seconds:
- engine: `Engine(model, num_pages, page_size=16, max_batch=8, chunk=64)`, all requests submitted
  at once, compiled before timing (two programs), median of --repeats runs;
- static tfx: batches of 8 in submission order, each `tfx.generate` run to its longest request
  (the rows that finished early keep decoding: static batching's waste), timed warm (each
  batch's program compiled by a first call that is not timed), one run;
- transformers: the first --hf-batches of those batches (its steps are slow on this machine),
  `generate` greedy with min_new_tokens = max_new_tokens = the batch's longest, left-padded,
  one run, compared with tfx's static batches on the same requests.
Memory: the engine's page pool against the dense KV cache `tfx.generate`'s batch of 8 allocates
for max_len tokens per row (`Decoder.init_cache(8, max_len)`), and the most pages in use at once.
Scaled down from 200-300 prompts so the run stays near 10 minutes on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import tempfile
import time
import warnings

import numpy as np
from flax import nnx
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

import tfx
import tfx.hf
from tfx.generation import Engine
from tfx.models import create

MAX_BATCH, PAGE_SIZE, CHUNK, MAX_LEN = 8, 16, 64, 1024


def workload(count: int, max_prompt: int, max_new: int, seed: int = 0):
    """`count` prompts of 1..max_prompt byte ids and 1..max_new new tokens each."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, rng.integers(1, max_prompt + 1)).tolist()
               for _ in range(count)]
    return prompts, rng.integers(1, max_new + 1, count).tolist()


def run_engine(engine: Engine, prompts, news) -> tuple[float, int]:
    """Seconds to serve every request, and the most pages in use at once."""
    start, peak = time.perf_counter(), 0
    for prompt, new in zip(prompts, news, strict=True):
        engine.submit(prompt, max_new_tokens=new)
    while engine.num_pending:
        engine.step()
        peak = max(peak, engine.allocator.num_pages - engine.allocator.num_free)
    return time.perf_counter() - start, peak


def batches(prompts, news):
    """Static batches of MAX_BATCH in order: left-padded ids, mask, the longest new count."""
    for i in range(0, len(prompts), MAX_BATCH):
        group = prompts[i:i + MAX_BATCH]
        width = max(map(len, group))
        ids = np.zeros((len(group), width), np.int64)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
        yield ids, mask, max(news[i:i + MAX_BATCH])


def run_static_tfx(model, prompts, news) -> list[float]:
    """Warm seconds of each static batch with tfx.generate (each compiled by an untimed call)."""
    times = []
    for ids, mask, new in batches(prompts, news):
        call = functools.partial(tfx.generate, model, ids, attention_mask=mask,
                                 max_new_tokens=new, temperature=0.0)
        call().block_until_ready()
        start = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def run_transformers(hf_model, prompts, news) -> float:
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for ids, mask, new in batches(prompts, news):
            hf_model.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return time.perf_counter() - start


def load_transformers(model, folder: pathlib.Path):
    import transformers

    tfx.hf.save(model, folder, architecture="LlamaForCausalLM")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    for config in (hf_model.config, hf_model.generation_config):
        config.eos_token_id = config.bos_token_id = None  # no EOS: exactly max_new_tokens
    hf_model.generation_config.pad_token_id = 0
    return hf_model


def measure(args) -> dict:
    model = create("char-gpt", max_len=MAX_LEN, rngs=nnx.Rngs(0))
    prompts, news = workload(args.prompts, args.max_prompt, args.max_new)
    engine = Engine(model, num_pages=args.num_pages, page_size=PAGE_SIZE, max_batch=MAX_BATCH,
                    chunk=CHUNK)
    engine.generate([[1] * 70, [2]], max_new_tokens=2)  # compile both programs, untimed
    runs = [run_engine(engine, prompts, news) for _ in range(args.repeats)]
    engine_s = statistics.median(seconds for seconds, _ in runs)
    print(f"engine: {sum(news) / engine_s:.0f} tokens/s", flush=True)
    static = run_static_tfx(model, prompts, news)
    print(f"static tfx.generate: {sum(news) / sum(static):.0f} tokens/s", flush=True)
    # transformers on the first --hf-batches batches only (its steps are slow here).
    subset = args.hf_batches * MAX_BATCH
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_s = run_transformers(load_transformers(model, pathlib.Path(folder)),
                                prompts[:subset], news[:subset])
    print(f"transformers: {sum(news[:subset]) / hf_s:.0f} tokens/s", flush=True)
    dense = model.init_cache(MAX_BATCH, MAX_LEN)
    return {"prompts": len(prompts), "useful_new_tokens": sum(news),
            "static_decoded_tokens": sum(len(ids) * new for ids, _, new in batches(prompts, news)),
            "seconds": {"engine": engine_s, "static_tfx": sum(static)},
            "engine_runs_seconds": [seconds for seconds, _ in runs],
            "static_batch_seconds": static,
            "tokens_per_second": {"engine": sum(news) / engine_s,
                                  "static_tfx": sum(news) / sum(static)},
            "subset": {"prompts": len(prompts[:subset]),
                       "useful_new_tokens": sum(news[:subset]),
                       "seconds": {"static_tfx": sum(static[:args.hf_batches]),
                                   "transformers": hf_s}},
            "memory": {"page_pool_bytes": engine.pool_bytes, "dense_cache_bytes": dense.nbytes,
                       "num_pages": args.num_pages,
                       "peak_pages_in_use": max(peak for _, peak in runs)}}


def render(results: dict) -> str:
    rate, seconds, memory = (results["tokens_per_second"], results["seconds"],
                             results["memory"])
    subset = results["subset"]
    hf = subset["seconds"]
    rows = [["engine (continuous batching, paged)", rate["engine"], seconds["engine"], 1.0],
            ["static batches, tfx.generate", rate["static_tfx"], seconds["static_tfx"],
             seconds["static_tfx"] / seconds["engine"]]]
    hf_rows = [["static batches, tfx.generate", subset["useful_new_tokens"] / hf["static_tfx"],
                hf["static_tfx"], 1.0],
               ["static batches, transformers generate",
                subset["useful_new_tokens"] / hf["transformers"], hf["transformers"],
                hf["transformers"] / hf["static_tfx"]]]
    page_bytes = memory["page_pool_bytes"] // memory["num_pages"]
    return "\n".join([
        "# Serving: continuous batching vs static batching", "",
        f"`{results['command']}` at revision {results['revision']} ({results['date']}), jax "
        f"{results['jax']}, torch {results.get('torch')}, transformers "
        f"{results.get('transformers')}, {results['cpus']} CPUs shared with other jobs (load "
        f"average {results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after).", "",
        f"{results['prompts']} requests, {results['useful_new_tokens']} new tokens in all "
        f"(static batches decode {results['static_decoded_tokens']} rows x steps). max_batch "
        f"{MAX_BATCH}, page_size {PAGE_SIZE}, chunk {CHUNK}, char-gpt shape, max_len {MAX_LEN}, "
        f"float32, no EOS. Engine: median of {results['repeats']} runs.", "",
        markdown_table(["all requests", "useful tokens/s", "seconds", "time / engine"], rows),
        "", f"transformers on the first {subset['prompts']} requests only "
        f"({subset['useful_new_tokens']} new tokens), against tfx's static batches on the same:",
        "", markdown_table(["first requests", "useful tokens/s", "seconds", "time / tfx"],
                           hf_rows), "",
        markdown_table(["KV memory", "MiB"], [
            ["dense cache, batch 8 x max_len", memory["dense_cache_bytes"] / 2**20],
            [f"page pool ({memory['num_pages']} pages of {PAGE_SIZE})",
             memory["page_pool_bytes"] / 2**20],
            [f"pages in use at peak ({memory['peak_pages_in_use']})",
             memory["peak_pages_in_use"] * page_bytes / 2**20]]), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=256,
                        help="pool pages (default: half the tokens of the dense cache)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-batches", type=int, default=1,
                        help="static batches that transformers runs (the first ones)")
    parser.add_argument("--quick", action="store_true", help="16 prompts, 1-64 new tokens")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new, args.repeats, args.hf_batches = 16, 64, 1, 1
    results = {**provenance("serving.py"), "load_average_before": os.getloadavg(),
               "repeats": args.repeats}
    results |= measure(args)
    results["load_average_after"] = os.getloadavg()
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
