"""lm-eval loglikelihood throughput: the tfx adapter (tfx.evaluation.TfxLM) vs lm-eval's hf backend.

    python benchmarks/lm_eval.py                         # 256 questions, 5-shot, batch 32
    python benchmarks/lm_eval.py --quick                 # 32 questions, 1 repeat: a smoke run
    python benchmarks/lm_eval.py --vocab-size 32000 --json r.json   # a LLaMA-sized vocabulary

One random LLaMA checkpoint written by transformers' save_pretrained (4 layers, width 256, 4
heads with 2 KV heads, SwiGLU 688, float32; the byte-level BPE tokenizer of
experiments/tiny_chat_model.py, its ~360 tokens unless --vocab-size widens the model's
vocabulary) is loaded by both:
- tfx: `TfxLM.from_path(folder)` (`tfx.hf.load`, jitted scoring in length buckets, rows that
  share an input scored once, the head only at the continuation's positions);
- hf: `HFLM(pretrained=folder, device="cpu", dtype="float32")`, its default logits cache on,
  torch's default thread count.
Both answer the same `loglikelihood` requests: lm-eval builds them from the multiple-choice task
tests/evaluation/tasks/tfx_arithmetic.yaml over --questions generated questions (3-4 choices
each) with --shots examples in each prompt, at the same --batch-size. Each repeat times one
whole `loglikelihood` call per backend, alternately, after one warm-up call each (tfx
compiles then). requests/s counts requests; tokens/s counts each request's context +
continuation tokens (the same for both). "tfx / hf" is a ratio of throughputs (issue goal:
>= 1.5): of the medians, and the median of each round's ratio (the two calls of a round run
back to back, so a busy machine slows both alike).
The largest difference of the two backends' log-likelihoods is reported as a parity check.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
import warnings

from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

ROOT = pathlib.Path(__file__).resolve().parents[1]
# This file's own name would shadow the lm_eval package: drop its folder from the import path
# (timing is imported already) and reach experiments/tiny_chat_model.py for the tokenizer.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.append(str(ROOT / "experiments"))
TASK = ROOT / "tests" / "evaluation" / "tasks" / "tfx_arithmetic.yaml"
MODEL_FIELDS = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    tie_word_embeddings=False)


def write_checkpoint(folder: pathlib.Path, vocab_size: int | None) -> pathlib.Path:
    import torch
    import transformers
    from tiny_chat_model import chat_tokenizer

    tokenizer = chat_tokenizer(transformers, folder)
    config = transformers.LlamaConfig(
        **MODEL_FIELDS, vocab_size=max(vocab_size or 0, len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_task(folder: pathlib.Path, questions: int) -> pathlib.Path:
    """The test task's YAML over `questions` distinct "What is a plus b?" documents."""
    rng = random.Random(0)
    pairs = rng.sample([(a, b) for a in range(100) for b in range(100)], questions)
    with open(folder / "qa.jsonl", "w") as out:
        for a, b in pairs:
            choices = sorted({str(a + b), str(a + b + 1), str(abs(a - b)), str(a * b + 2)})
            out.write(json.dumps({"question": f"What is {a} plus {b}?", "choices": choices,
                                  "answer": choices.index(str(a + b))}) + "\n")
    yaml = TASK.read_text().replace("test: qa.jsonl", f"test: {folder / 'qa.jsonl'}")
    (folder / TASK.name).write_text(yaml)
    return folder


def task_requests(task_folder: pathlib.Path, shots: int) -> list:
    """lm-eval's loglikelihood Instances for the task, as simple_evaluate builds them."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder), include_defaults=False)
    task = manager.load(["tfx_arithmetic"])["tasks"]["tfx_arithmetic"]
    task.set_config(key="num_fewshot", value=shots)
    task.build_all_requests(rank=0, world_size=1)
    return task.instances


def measure(args, folder: pathlib.Path, requests: list) -> dict:
    from lm_eval.models.huggingface import HFLM

    from tfx.evaluation import TfxLM

    backends = {"tfx": TfxLM.from_path(folder, batch_size=args.batch_size),
                "hf": HFLM(pretrained=str(folder), device="cpu", dtype="float32",
                           batch_size=args.batch_size)}
    tokens = sum(len(c) + len(t) for c, t in (backends["tfx"]._encode_pair(*r.args)
                                              for r in requests))
    answers, times = {}, {name: [] for name in backends}
    for repeat in range(args.repeats + 1):  # the first round warms up (tfx compiles)
        for name, lm in backends.items():
            start = time.perf_counter()
            answers[name] = lm.loglikelihood(requests, disable_tqdm=True)
            if repeat:
                times[name].append(time.perf_counter() - start)
    row = {"requests": len(requests), "tokens": tokens,
           "max_abs_logprob_difference": max(abs(a[0] - b[0]) for a, b in
                                             zip(answers["tfx"], answers["hf"], strict=True)),
           "is_greedy_equal": [a[1] for a in answers["tfx"]] == [b[1] for b in answers["hf"]]}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        row[name] = {"seconds": median, "all_seconds": seconds,
                     "requests_per_s": len(requests) / median, "tokens_per_s": tokens / median}
    row["tfx_over_hf"] = row["tfx"]["requests_per_s"] / row["hf"]["requests_per_s"]
    row["tfx_over_hf_per_round"] = statistics.median(
        h / t for t, h in zip(times["tfx"], times["hf"], strict=True))
    return row


def render(results: dict) -> str:
    r = results["loglikelihood"]
    rows = [[name, r[name]["requests_per_s"], r[name]["tokens_per_s"], r[name]["seconds"]]
            for name in ("tfx", "hf")]
    return "\n".join([
        f"# lm-eval loglikelihood throughput ({results['revision']}, {results['date']})", "",
        f"`{results['command']}`: {r['requests']} requests, {r['tokens']} tokens, "
        f"batch {results['batch_size']}, {results['shots']}-shot, vocabulary "
        f"{results['vocab_size']}, median of {results['repeats']}.", "",
        markdown_table(["backend", "requests/s", "tokens/s", "seconds"], rows), "",
        f"tfx / hf throughput: **{r['tfx_over_hf']:.2f}x** (goal >= 1.5; median of the "
        f"rounds' ratios {r['tfx_over_hf_per_round']:.2f}x). Largest "
        f"log-likelihood difference {r['max_abs_logprob_difference']:.2g}, greedy flags equal: "
        f"{r['is_greedy_equal']}."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, help="widen the model's vocabulary to this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 questions, 1 repeat")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.questions, args.repeats = 32, 1
    if not 8 <= args.questions <= 10_000:
        parser.error("--questions must be in [8, 10000]")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("lm-eval, torch and transformers are needed: pip install -e '.[bench]' lm-eval")
    results = {**provenance("lm_eval.py"), "repeats": args.repeats, "shots": args.shots,
               "batch_size": args.batch_size, "model": MODEL_FIELDS,
               "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = write_checkpoint(pathlib.Path(tmp) / "llama", args.vocab_size)
        results["vocab_size"] = json.loads((folder / "config.json").read_text())["vocab_size"]
        requests = task_requests(write_task(pathlib.Path(tmp), args.questions), args.shots)
        results["loglikelihood"] = measure(args, folder, requests)
    results["load_average_after"] = os.getloadavg()
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
