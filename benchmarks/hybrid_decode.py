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
For each context length L (the prompt) and batch, both sides prefill the prompt once (not
timed), then run N greedy decoding steps from that cache, each step feeding back its argmax:
tfx as one jitted `lax.fori_loop` over `model(token, cache=cache)` (what `tfx.generate` runs
after its prefill), transformers as its forward with `past_key_values` in a Python loop (what
its `generate` runs). A step costs the time of the N steps / N; tokens/s counts the new tokens
of the whole batch. "step 4k/256" is how much a step costs more at the longer context: 1 means
flat. Times are medians of --repeats runs, tfx and transformers alternating. Greedy
`tfx.generate` and transformers' `generate` are checked to give the same tokens (not timed).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
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


def tfx_decoder(model, prompts: np.ndarray, steps: int):
    """A blocking call that runs `steps` greedy decoding steps after the prefilled prompt."""
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(prompts, jnp.int32)

    @jax.jit
    def prefill(state, ids):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(ids.shape[0], ids.shape[1] + steps + 1)
        logits, cache = model(ids, cache=cache)
        return jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32), cache

    @jax.jit
    def decode(state, token, cache):
        model = nnx.merge(graphdef, state)

        def step(_, carry):
            token, cache = carry
            logits, cache = model(token, cache=cache)
            return jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, steps, step, (token, cache))[0]

    token, cache = prefill(state, ids)
    return lambda: decode(state, token, cache).block_until_ready()


def torch_decoder(hf_model, prompts: np.ndarray, steps: int):
    """A call that prefills (not timed) and returns the seconds of `steps` greedy steps."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))

    def run() -> float:
        with torch.no_grad():
            out = hf_model(ids, use_cache=True)
            start = time.perf_counter()
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                out = hf_model(token, past_key_values=out.past_key_values, use_cache=True)
            return time.perf_counter() - start

    return run


def same_tokens(model, hf_model, prompts: np.ndarray, steps: int) -> bool:
    """Whether greedy tfx.generate and transformers' generate give the same new tokens."""
    import torch

    ours = np.asarray(tfx.generate(model, jnp.asarray(prompts, jnp.int32),
                                   max_new_tokens=steps, temperature=0.0))
    ids = torch.from_numpy(prompts.astype(np.int64))
    with torch.no_grad():
        theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=steps, min_new_tokens=steps).numpy()
    return np.array_equal(ours, theirs)


def step_seconds(model, hf_model, prompts: np.ndarray, steps: int, repeats: int) -> dict:
    """Median seconds of one decoding step on each side (tfx alone when hf_model is None)."""
    ours = tfx_decoder(model, prompts, steps)
    ours()  # compiles
    theirs = None if hf_model is None else torch_decoder(hf_model, prompts, steps)
    times = {"tfx": []} | ({} if theirs is None else {"transformers": []})
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        times["tfx"].append(time.perf_counter() - start)
        if theirs is not None:
            times["transformers"].append(theirs())
    return {name: statistics.median(t) / steps for name, t in times.items()}


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
                    step = step_seconds(model, hf_model, prompts, args.new_tokens,
                                        args.repeats)
                    same = (None if hf_model is None
                            else same_tokens(model, hf_model, prompts, args.check_tokens))
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
    parser.add_argument("--new-tokens", type=int, default=64, help="N: the decoding steps timed")
    parser.add_argument("--check-tokens", type=int, default=16,
                        help="new tokens compared between tfx.generate and transformers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="context 64, batch 1, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.batches, args.repeats, args.new_tokens = [32, 64], [1], 1, 8
        args.check_tokens = 4
    if min(args.contexts + args.batches) < 1 or args.repeats < 1 or args.new_tokens < 1:
        parser.error("--contexts, --batches, --repeats and --new-tokens must be >= 1")
    results = {"provenance": provenance("hybrid_decode.py"), "contexts": args.contexts,
               "rows": measure(args)}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
