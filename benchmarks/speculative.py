"""Speculative greedy decoding vs the target alone: tfx.speculative_generate vs tfx.generate.

    python benchmarks/speculative.py                 # train (or reuse) the models, then measure
    python benchmarks/speculative.py --quick         # 16 new tokens, 1 repeat: a smoke run
    python benchmarks/speculative.py --json benchmarks/results/speculative.json

Acceptance needs trained models, so the script first trains two byte-level models on the
embedded corpus (the Python standard library's source) with `tfx.train.train`, and keeps them
in --cache-dir (default: the temp folder) so that a second run measures at once:
- target: char-gpt (a LLaMA-style decoder: 4 layers, width 256, GQA 4/2 heads), trained as
  the gpt_char experiment (16 x 128 bytes a step) for --steps steps (default 200);
- draft: the same recipe with 1 layer of width 128 (2 heads), about 1/16 of the target's
  matrix work per token.
Drafts measured: (a) self-speculative, `early_exit_draft(target, n)`: the target's first n
layers (1 and 2) with its final norm and head (no second model; the target was not trained
for early exit); (b) the small trained draft.
Each case decodes the same prompts (the first lines of validation files) greedily with
`tfx.generate(target)` and with `tfx.speculative_generate(target, draft, k)`; the runs alternate
in this process and times are medians of --repeats warm runs. tokens/s counts new tokens of the
whole batch; speed-up is the target-alone time over the speculative time (above 1: faster).
Acceptance rate: accepted / drafted tokens; tokens per target call: new tokens / target calls
(1 for plain decoding). Greedy outputs are checked to be equal token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import timing
from decode import alternating_medians
from flax import nnx

import tfx
from tfx.generation import early_exit_draft
from tfx.train import get_experiment, load_run, train

TARGET_LAYERS = 4
PROMPT_LEN = 32


def experiments(steps: int) -> dict:
    """The target's and the draft's training runs: gpt_char (4 layers), and the same with 1 layer
    of width 128."""
    base = get_experiment("gpt_char")
    loop = dataclasses.replace(base.train, steps=steps, eval_every=steps,
                               checkpoint_every=steps)
    draft_model = base.model.replace(num_layers=1, d_model=128, num_heads=2, d_ff=512)
    return {"target": dataclasses.replace(base, model=base.model.replace(
                num_layers=TARGET_LAYERS), train=loop),
            "draft": dataclasses.replace(base, name="gpt_char_draft", model=draft_model,
                                         train=loop)}


def trained(name: str, experiment, cache_dir: pathlib.Path):
    """The run of `experiment` in cache_dir/name, trained now unless already finished there;
    and the seconds training took (None when it was cached)."""
    workdir = cache_dir / f"{name}-{experiment.train.steps}"
    checkpoints = workdir / "checkpoints"
    seconds = None
    if not (checkpoints.exists() and str(experiment.train.steps) in os.listdir(checkpoints)):
        print(f"training the {name} ({experiment.model.num_layers} layers, width "
              f"{experiment.model.d_model}, {experiment.train.steps} steps) in {workdir}",
              flush=True)
        start = time.perf_counter()
        train(experiment, workdir, progress=False)
        seconds = time.perf_counter() - start
    return load_run(workdir), seconds


def prompts(tokenizer, batch: int) -> np.ndarray:
    """`batch` prompts of PROMPT_LEN bytes, spread over benchmarks/decode.py: Python source
    that the training corpus (the standard library) does not hold."""
    text = (pathlib.Path(__file__).parent / "decode.py").read_text()
    ids = np.asarray(tokenizer.encode(text))
    starts = np.linspace(0, len(ids) - PROMPT_LEN, batch).astype(int)
    return np.stack([ids[s:s + PROMPT_LEN] for s in starts]).astype(np.int32)


def measure(target, draft, ids, args, k: int) -> dict:
    """Target alone vs speculative with `draft` and k draft tokens, greedy, on `ids`."""
    def alone():
        return jax.block_until_ready(tfx.generate(
            target, ids, max_new_tokens=args.new_tokens, temperature=0.0))

    def speculative():
        return jax.block_until_ready(tfx.speculative_generate(
            target, draft, ids, max_new_tokens=args.new_tokens, num_draft_tokens=k,
            temperature=0.0))

    reference = np.asarray(alone())
    out, stats = tfx.speculative_generate(target, draft, ids, max_new_tokens=args.new_tokens,
                                          num_draft_tokens=k, temperature=0.0,
                                          return_stats=True)
    seconds = alternating_medians({"alone": alone, "speculative": speculative}, args.repeats)
    tokens = ids.shape[0] * args.new_tokens
    return {"k": k, "batch": ids.shape[0], "new_tokens": args.new_tokens,
            "same_tokens": bool(np.array_equal(np.asarray(out), reference)),
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_target_call": stats.tokens_per_target_call,
            "alone_s": seconds["alone"], "speculative_s": seconds["speculative"],
            "alone_tokens_per_s": tokens / seconds["alone"],
            "speculative_tokens_per_s": tokens / seconds["speculative"],
            "speed_up": seconds["alone"] / seconds["speculative"],
            "target_call_k_plus_1_vs_1": call_cost(target, ids.shape[0], k)}


def call_cost(model, batch: int, k: int) -> float:
    """Time of one cached call of `model` on k + 1 tokens over its time on 1 token (a round's
    target call against a plain decoding step), batch rows, 32 tokens cached."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def call(state, ids, cache):
        return nnx.merge(graphdef, state).hidden_states(ids, cache=cache)

    _, cache = call(state, jnp.zeros((batch, PROMPT_LEN), jnp.int32),
                    model.init_cache(batch, PROMPT_LEN + 16))
    seconds = [timing.median_seconds(lambda n=n: jax.block_until_ready(
        call(state, jnp.ones((batch, n), jnp.int32), cache)), repeats=21) for n in (1, k + 1)]
    return seconds[1] / seconds[0]


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    t = results["training"]
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, {results['cpus']} CPUs shared with other "
        f"jobs: load average (1 min) {results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after.",
        "",
        f"Greedy decoding of {results['rows'][0]['new_tokens']} new tokens after "
        f"{PROMPT_LEN}-byte prompts, float32. Target: char-gpt with {TARGET_LAYERS} layers, "
        f"width 256, trained {t['steps']} steps (validation loss {t['target_val_loss']:.2f} "
        f"nats/byte); small draft: 1 layer, width 128, same recipe (validation loss "
        f"{t['draft_val_loss']:.2f}); training seconds in this run (None: reused from "
        f"--cache-dir): {t['seconds']}. Medians of {results['repeats']} alternating runs; "
        "speed-up = target-alone time / speculative time; every speculative output equals the "
        "target's alone token for token (checked). Last column: the time of one cached target "
        "call on k + 1 tokens over one on 1 token (what a round's verification costs against a "
        "plain decoding step).",
        "",
        timing.markdown_table(
            ["draft", "k", "batch", "acceptance", "tokens / target call",
             "target alone tokens/s", "speculative tokens/s", "speed-up", "same tokens",
             "target call k+1 / 1 token"],
            [[r["draft"], r["k"], r["batch"], r["acceptance_rate"], r["tokens_per_target_call"],
              r["alone_tokens_per_s"], r["speculative_tokens_per_s"], r["speed_up"],
              "yes" if r["same_tokens"] else "NO", r["target_call_k_plus_1_vs_1"]]
             for r in results["rows"]]),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each model")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4])
    parser.add_argument("--draft-tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 4])
    parser.add_argument("--early-exit-layers", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=pathlib.Path,
                        default=pathlib.Path(tempfile.gettempdir()) / "tfx-speculative-bench")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 1 repeat")
    timing.add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    results = {**timing.provenance("speculative.py"), "repeats": args.repeats,
               "load_average_before": os.getloadavg()}
    runs, training_s = {}, {}
    for name, experiment in experiments(args.steps).items():
        runs[name], training_s[name] = trained(name, experiment, args.cache_dir)
    target = runs["target"].model
    drafts = {f"early exit ({n} of {TARGET_LAYERS} layers)": early_exit_draft(target, n)
              for n in args.early_exit_layers}
    drafts["small trained (1 layer, width 128)"] = runs["draft"].model
    rows = []
    for batch in args.batches:
        ids = prompts(runs["target"].tokenizer, batch)
        for name, draft in drafts.items():
            for k in args.draft_tokens:
                row = {"draft": name, **measure(target, draft, ids, args, k)}
                print(row, flush=True)
                rows.append(row)
    results["rows"] = rows
    results["training"] = {"steps": args.steps, "seconds": training_s, **{
        f"{name}_val_loss": last_val_loss(args.cache_dir / f"{name}-{args.steps}")
        for name in runs}}
    results["load_average_after"] = os.getloadavg()
    timing.publish(render(results), results, json_path=args.json,
                   markdown_path=timing.markdown_path(args))


def last_val_loss(workdir: pathlib.Path) -> float:
    """The last validation loss in a run's metrics.jsonl (nan when none was logged)."""
    import json

    losses = [record["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
              if (record := json.loads(line)).get("split") == "val"]
    return losses[-1] if losses else float("nan")


if __name__ == "__main__":
    main()
