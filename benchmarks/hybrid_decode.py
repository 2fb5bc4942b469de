"""Decoding a hybrid model (Gated DeltaNet layers with a full-attention layer every fourth, the
layout of Qwen3.5 and Qwen3-Next): tfx.generate against transformers on the same weights, and
the cost of one decoding step as the context grows.

    python benchmarks/hybrid_decode.py                   # contexts 256 and 4096, batch 1 and 8
    python benchmarks/hybrid_decode.py --quick           # context 64, batch 1, 1 repeat
    python benchmarks/hybrid_decode.py --json benchmarks/results/hybrid_decode.json

Two models with random weights, written by transformers' `save_pretrained` and read with
`tfx.hf.load`, so both sides decode with the same weights (float32, greedy, no EOS):
  - "hybrid": Qwen3.5's text model (Qwen3_5ForCausalLM) with 4 layers, 3 linear + 1 full
    attention, width 256;
  - "linear": the same with all 4 layers linear, whose step cost cannot depend on the context
    (tfx only: transformers 5.25's generate fails on a model without attention layers, in
    `get_mask_sizes`).
For each context length L (the prompt) and batch, each side generates N0 and N0 + N new tokens
after the same prompt; one decoding step costs (time(N0 + N) - time(N0)) / N, which removes
the prefill and the first tokens. tokens/s counts the new tokens of the whole batch per
second of decoding steps. "step ratio 4k/256" is how much a step costs more at the longer
context: 1 means flat. Times are medians of --repeats runs, tfx and transformers alternating.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

import tfx
import tfx.hf

VOCAB = 4096


def hf_config(linear_only: bool):
    """A small Qwen3.5 text config: 4 layers (3 Gated DeltaNet + 1 attention, or 4 linear)."""
    import transformers

    kinds = ["linear_attention"] * 3 + ["linear_attention" if linear_only else "full_attention"]
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, layer_types=kinds,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=8192,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def build(linear_only: bool, folder: pathlib.Path):
    """(tfx model, transformers model) with the same random weights."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf_model = transformers.Qwen3_5ForCausalLM(hf_config(linear_only)).eval()
    hf_model.save_pretrained(folder)
    for config in (hf_model.config, hf_model.generation_config):
        config.eos_token_id = config.bos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return tfx.hf.load(folder), hf_model


def runners(model, hf_model, prompts: np.ndarray, new_tokens: int) -> dict:
    """Blocking calls that generate `new_tokens` greedy tokens after `prompts` on each side
    (tfx alone when hf_model is None)."""
    import torch

    ids = jax.numpy.asarray(prompts, jax.numpy.int32)
    torch_ids = torch.from_numpy(prompts.astype(np.int64))

    def ours():
        return np.asarray(tfx.generate(model, ids, max_new_tokens=new_tokens, temperature=0.0))

    def theirs():
        with torch.no_grad():
            return hf_model.generate(torch_ids, attention_mask=torch.ones_like(torch_ids),
                                     do_sample=False, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens).numpy()

    return {"tfx": ours} if hf_model is None else {"tfx": ours, "transformers": theirs}


def step_seconds(model, hf_model, prompts: np.ndarray, first: int, more: int,
                 repeats: int) -> tuple[dict, bool | None]:
    """Seconds of one decoding step on each side, and whether their tokens agree (None
    without transformers)."""
    short, long = (runners(model, hf_model, prompts, n) for n in (first, first + more))
    outputs = {name: run() for name, run in long.items()}  # also warms both up
    same = None if hf_model is None else np.array_equal(outputs["tfx"], outputs["transformers"])
    short["tfx"]()
    times = {(name, n): [] for name in long for n in ("short", "long")}
    for _ in range(repeats):
        for name in long:
            for n, run in (("short", short[name]), ("long", long[name])):
                start = time.perf_counter()
                run()
                times[name, n].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {name: (median[name, "long"] - median[name, "short"]) / more for name in long}, same


def measure(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("hybrid", "linear"):
            folder = pathlib.Path(tmp) / kind
            model, hf_model = build(kind == "linear", folder)
            hf_model = hf_model if kind == "hybrid" else None
            for batch in args.batches:
                for context in args.contexts:
                    prompts = np.random.default_rng(context + batch).integers(
                        1, VOCAB, (batch, context))
                    step, same = step_seconds(model, hf_model, prompts, args.first,
                                              args.new_tokens, args.repeats)
                    row = {"model": kind, "batch": batch, "context": context,
                           "tokens_equal": same}
                    for name, s in step.items():
                        row[f"{name}_step_ms"] = 1e3 * s
                        row[f"{name}_tokens_per_s"] = batch / s
                    if "transformers" in step:
                        row["time_vs_transformers"] = step["tfx"] / step["transformers"]
                    rows.append(row)
                    print(row, flush=True)
    return rows


def render(results: dict) -> str:
    rows = results["rows"]
    table = markdown_table(
        ["model", "batch", "context", "tfx ms/step", "transformers ms/step", "tfx tok/s",
         "transformers tok/s", "tfx / transformers time", "same tokens"],
        [[r["model"], r["batch"], r["context"], r["tfx_step_ms"], r.get("transformers_step_ms"),
          r["tfx_tokens_per_s"], r.get("transformers_tokens_per_s"),
          r.get("time_vs_transformers"), r["tokens_equal"]] for r in rows])
    lo, hi = min(results["contexts"]), max(results["contexts"])
    growth = []
    for r in rows:
        if r["context"] == hi:
            base = next(b for b in rows if b["model"] == r["model"] and b["batch"] == r["batch"]
                        and b["context"] == lo)
            theirs = ("transformers_step_ms" in r
                      and r["transformers_step_ms"] / base["transformers_step_ms"])
            growth.append([r["model"], r["batch"], r["tfx_step_ms"] / base["tfx_step_ms"],
                           theirs or None])
    flat = markdown_table(["model", "batch", f"tfx step {hi}/{lo}",
                           f"transformers step {hi}/{lo}"], growth)
    p = results["provenance"]
    return (f"# Hybrid decoding: tfx.generate vs transformers\n\n`{p['command']}` at "
            f"{p['revision']} ({p['date']}, jax {p['jax']}, torch {p.get('torch')}, "
            f"transformers {p.get('transformers')}, {p['cpus']} CPUs)\n\n{table}\n\n"
            f"Growth of one step's cost with the context:\n\n{flat}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--first", type=int, default=8, help="N0: tokens of the short run")
    parser.add_argument("--new-tokens", type=int, default=32, help="N: the decoding steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="context 64, batch 1, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.batches, args.repeats, args.new_tokens = [32, 64], [1], 1, 8
    if min(args.contexts + args.batches) < 1 or args.repeats < 1 or args.new_tokens < 1:
        parser.error("--contexts, --batches, --repeats and --new-tokens must be >= 1")
    results = {"provenance": provenance("hybrid_decode.py"), "contexts": args.contexts,
               "rows": measure(args)}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
