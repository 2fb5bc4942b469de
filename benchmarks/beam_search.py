"""Decoder beam search and logits processors: tfx vs transformers on the same weights.

    python benchmarks/beam_search.py                 # 64 new tokens, 3 repeats
    python benchmarks/beam_search.py --quick         # 8 new tokens, 1 repeat: a smoke run
    python benchmarks/beam_search.py --torch-threads 1 --json benchmarks/results/beam_search.json

A LLaMA-shaped model with grouped-query attention (4 layers, width 256, 8 heads, 2 KV heads,
vocab 4096, float32) with random weights, made by transformers and read by `tfx.hf.load` from
its save_pretrained folder. Prompts: a left-padded batch of 4 prompts of 32, 24, 16 and 8 tokens.
- beam search: `tfx.beam_search(num_beams=4)` vs transformers' `generate(num_beams=4)`, no EOS;
- processors: greedy `tfx.generate` with repetition_penalty, no_repeat_ngram_size,
  bad_words_ids and min_new_tokens on, vs the same without processors (the loop's overhead of
  the processors) and vs transformers' greedy generate with the same processors.
tfx is warm (compiled once before timing). Times are medians of --repeats runs, tfx and
transformers alternating; ratios are of times (below 1: tfx is faster). Tokens are compared
with transformers' (beam search: the best hypothesis of every prompt).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import timing

import tfx
import tfx.hf

FIELDS = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
PROMPT_LENGTHS = (32, 24, 16, 8)
PROCESSORS = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=4,
                  bad_words_ids=[[7], [11, 13]])


def _models(torch, transformers):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**FIELDS, attn_implementation="eager")
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.generation_config.eos_token_id = None
    folder = tempfile.mkdtemp()
    hf_model.save_pretrained(folder)
    return hf_model, tfx.hf.load(folder)


def _prompts():
    rng = np.random.default_rng(0)
    width = max(PROMPT_LENGTHS)
    ids = np.zeros((len(PROMPT_LENGTHS), width), np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length:] = rng.integers(20, FIELDS["vocab_size"], length)
        mask[row, width - length:] = 1
    return ids, mask


def _measure(torch, hf_model, model, new: int, repeats: int) -> list[dict]:
    """One row per workload: times of tfx and transformers, and whether the tokens agree."""
    ids, mask = _prompts()
    hf_inputs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     do_sample=False, max_new_tokens=new, pad_token_id=0)
    width = ids.shape[1] + new
    workloads = [
        ("beam search, 4 beams", dict(num_beams=4),
         lambda: tfx.beam_search(model, ids, attention_mask=mask, num_beams=4,
                                 max_new_tokens=new, pad_token_id=0)),
        ("greedy + 4 processors", PROCESSORS | dict(eos_token_id=1),
         lambda: tfx.generate(model, ids, attention_mask=mask, max_new_tokens=new,
                              temperature=0.0, pad_token_id=0, eos_token_id=1, **PROCESSORS)),
        ("greedy, no processors", dict(),
         lambda: tfx.generate(model, ids, attention_mask=mask, max_new_tokens=new,
                              temperature=0.0, pad_token_id=0)),
    ]
    rows = []
    for name, hf_kwargs, ours in workloads:
        def theirs(kwargs=hf_kwargs):
            with torch.no_grad():
                return hf_model.generate(**hf_inputs, **kwargs).numpy()

        expected, got = theirs(), np.asarray(ours())
        expected = np.pad(expected, ((0, 0), (0, width - expected.shape[1])))
        tfx_s = timing.median_seconds(lambda f=ours: np.asarray(f()), repeats=repeats)
        hf_s = timing.median_seconds(theirs, repeats=repeats)
        rows.append({"workload": name, "tfx_s": tfx_s, "transformers_s": hf_s,
                     "tfx_over_transformers": tfx_s / hf_s,
                     "tokens_equal": bool(np.array_equal(got, expected))})
    rows[1]["overhead_vs_no_processors"] = rows[1]["tfx_s"] / rows[2]["tfx_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    parser.add_argument("--torch-threads", type=int,
                        help="torch's intra-op threads (default: torch's own choice)")
    timing.add_output_arguments(parser)
    args = parser.parse_args()
    new, repeats = (8, 1) if args.quick else (args.new_tokens, args.repeats)
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()[0]
    hf_model, model = _models(torch, transformers)
    rows = _measure(torch, hf_model, model, new, repeats)
    meta = timing.provenance("beam_search.py") | {"torch_threads": torch.get_num_threads(),
                                           "load_before": load_before,
                                           "load_after": os.getloadavg()[0]}
    table = timing.markdown_table(
        ["workload", "tfx s", "transformers s", "tfx / transformers (time)",
         "overhead vs no processors", "tokens equal"],
        [[r["workload"], r["tfx_s"], r["transformers_s"], r["tfx_over_transformers"],
          r.get("overhead_vs_no_processors"), r["tokens_equal"]] for r in rows])
    report = (f"Command: `{meta['command']}` at revision `{meta['revision']}` ({meta['date']});"
              f" jax {meta['jax']}, torch {meta['torch']}, transformers "
              f"{meta['transformers']}, {meta['cpus']} CPUs, torch threads "
              f"{meta['torch_threads']}; load average (1 min) {load_before:.1f} before, "
              f"{meta['load_after']:.1f} after (other agents share the machine).\n\n"
              f"## Decoder beam search and logits processors, prompts "
              f"{'/'.join(map(str, PROMPT_LENGTHS))} (left-padded) + {new} new tokens\n\n"
              f"LLaMA shape with GQA: 4 layers, width 256, 8 heads / 2 KV heads, vocab 4096, "
              f"float32, random weights shared through save_pretrained. Medians of {repeats} "
              f"runs, tfx warm. Processors: {PROCESSORS}.\n\n{table}\n\n"
              f"The machine is shared with other agents (load above, on 2 cores): torch's "
              f"threads contend with them, so transformers' times vary by several times "
              f"between runs; the ratios say which side is faster, not by how much exactly. "
              f"The processors' overhead is tfx's own two columns, measured alike.\n")
    timing.publish(report, {"meta": meta, "rows": rows}, json_path=args.json,
            markdown_path=timing.markdown_path(args))


if __name__ == "__main__":
    main()
