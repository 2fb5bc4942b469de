"""Multi-head vs grouped-query vs multi-query attention at equal width: quality, KV-cache size
and decoding speed.

    python experiments/attention_heads.py [--steps 200] [--json PATH] [--workdir DIR]
                                          [--out DIR] [--smoke]

Trains the char GPT of `tfx train gpt_char` (4 layers, d_model 256, RoPE, SwiGLU) with 8 query
heads of width 32 and 8 (MHA), 4, 2 (GQA) or 1 (MQA) key/value heads: the same steps, batches,
seed and learning rate for every variant. Then, per variant: the final validation loss; the
parameter count; training tokens/s; KV-cache bytes per token, read off the arrays that
`model.init_cache` returns (it must be 2 · layers · kv_heads · head_dim · 4 bytes in float32);
and greedy decoding tokens/s with `tfx.generation.generate` (8 validation prompts of 32 bytes
continued to the model's 256-token context, compiled first, prefill included): the median of
3 rounds that time every variant in turn, each round the median of 5 runs, so that a slow
moment of the machine cannot fall on one variant alone. Training tokens/s is the median of
the logged speeds of every 10 steps but the first. Writes
experiments/results/attention_heads.{md,json,png} (--out).

Paper claim (Ainslie et al. 2023, "GQA"): grouped-query attention keeps quality close to
multi-head attention while decoding almost as fast as multi-query attention, because each
decoded token reads fewer keys and values from memory. On CPU, decoding a model this small is
not bound by memory bandwidth (weights and cache largely stay in the caches), so the speed
difference may be small; the table reports what was measured.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import harness
import jax
import numpy as np
from flax import nnx

from tfx.generation import generate
from tfx.train.config import Experiment
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer

NAME = "attention_heads"
NUM_HEADS = 8
VARIANTS = {"mha": 8, "gqa4": 4, "gqa2": 2, "mqa": 1}  # name -> key/value heads
DECODE_BATCH = 8
PROMPT_LEN = 32
DECODE_REPEATS = 5
DECODE_ROUNDS = 3
NOTE = (f"\n{NUM_HEADS} query heads (each d_model / {NUM_HEADS} wide) in every variant; "
        "KV bytes/token from the float32 arrays of `init_cache`; decoding: greedy `generate`, "
        f"{DECODE_BATCH} prompts of {PROMPT_LEN} bytes, median of {DECODE_ROUNDS} rounds over "
        f"the variants in turn, each the median of {DECODE_REPEATS} runs after compiling. "
        "Ainslie et al. 2023 found GQA close to MHA in quality and close to MQA in decoding "
        "speed; the speed gain comes from reading fewer keys and values per token, and "
        "a CPU decoding a model this small is not memory-bound, so speed differences here may "
        "be small.\n")


def variant_experiment(kv_heads: int, steps: int, smoke: bool) -> Experiment:
    """gpt_char with NUM_HEADS query heads and `kv_heads` key/value heads; in smoke mode a
    one-layer model of width 64 trained for a few steps."""
    base = get_experiment("gpt_char")
    model = base.model.replace(num_heads=NUM_HEADS, attention={"num_kv_heads": kv_heads})
    if smoke:
        model = model.replace(d_model=64, d_ff=128, num_layers=1)
        train = harness.smoke_train(base.train)
    else:
        train = dataclasses.replace(base.train, steps=steps, eval_every=steps,
                                    checkpoint_every=steps)
    return dataclasses.replace(base, name=f"{NAME}_kv{kv_heads}", model=model, train=train)


def kv_bytes_per_token(model: nnx.Module, batch: int, max_len: int) -> float:
    """Bytes of cached keys and values per token, from an empty cache's arrays."""
    return model.init_cache(batch, max_len).nbytes / (batch * max_len)


def decode_tokens_per_s(model: nnx.Module, prompts: np.ndarray, new_tokens: int) -> float:
    """Greedy `generate` throughput: batch · new_tokens / the median time of DECODE_REPEATS
    runs, after one run that compiles."""
    def run():
        generate(model, prompts, max_new_tokens=new_tokens, temperature=0.0).block_until_ready()

    run()
    times = []
    for _ in range(DECODE_REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return prompts.shape[0] * new_tokens / statistics.median(times)


def train_variant(experiment: Experiment, workdir: Path) -> tuple[nnx.Module, np.ndarray, dict]:
    """Train `experiment` in `workdir`; return the trained model, the decoding prompts and its
    measurements but the decoding speed."""
    trained = harness.train_measured(experiment, workdir)
    trainer = Trainer(experiment, workdir, sharded=False)
    trainer.restore()
    model = trainer.model()
    prompts = trainer.feed.val_stream.eval_batches(1, DECODE_BATCH, PROMPT_LEN)[0][:, :PROMPT_LEN]
    trainer.close()
    config = experiment.model
    return model, prompts, {
        "kv_heads": config.kv_heads, "val_loss": trained["val_loss"],
        "kv_bytes_per_token": kv_bytes_per_token(model, DECODE_BATCH, config.max_len),
        "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        "train_tokens_per_s": trained["tokens_per_s"]}


def decode_rounds(trained: dict, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """{variant: decoding tokens/s of each round}; every round times each of `trained`
    ({variant: (model, prompts)}) in turn."""
    speeds = {name: [] for name in trained}
    for _ in range(rounds):
        for name, (model, prompts) in trained.items():
            speeds[name].append(decode_tokens_per_s(model, prompts, new_tokens))
    return speeds


def table(results: dict) -> str:
    """Every measured number, with MHA as the reference for the ratios."""
    mha = results["mha"]
    rows = [[name, r["kv_heads"], f"{r['params']:,}", f"{r['val_loss']:.4f}",
             f"{r['kv_bytes_per_token']:,.0f}",
             f"{r['kv_bytes_per_token'] / mha['kv_bytes_per_token']:.3f}",
             f"{r['train_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.0f}",
             " / ".join(f"{s:,.0f}" for s in r["decode_tokens_per_s_rounds"]),
             f"{r['decode_tokens_per_s'] / mha['decode_tokens_per_s']:.2f}"]
            for name, r in results.items()]
    return harness.markdown_table(
        ["variant", "KV heads", "params", "val loss (nats/byte)", "KV bytes/token",
         "KV bytes vs MHA", "train tokens/s", "decode tokens/s", "decode tokens/s per round",
         "decode speed vs MHA"],
        rows) + NOTE


def plot(results: dict, path: Path) -> None:
    """Validation loss and decoding speed against the number of key/value heads."""
    fig, (loss_ax, speed_ax) = harness.plt.subplots(1, 2, figsize=(10, 4))
    heads = [r["kv_heads"] for r in results.values()]
    for ax, key, label in ((loss_ax, "val_loss", "validation loss (nats/byte)"),
                           (speed_ax, "decode_tokens_per_s", "greedy decoding tokens/s")):
        ax.plot(heads, [r[key] for r in results.values()], marker="o")
        for name, r in results.items():
            ax.annotate(name, (r["kv_heads"], r[key]), textcoords="offset points",
                        xytext=(4, 4))
        ax.set_xscale("log", base=2)
        ax.set_xticks(heads, [str(h) for h in heads])
        ax.set_xlabel(f"key/value heads ({NUM_HEADS} query heads)")
        ax.set_ylabel(label)
    fig.suptitle("MHA vs GQA vs MQA, char GPT on the standard library")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Train and measure every variant, publish the table and plot; returns
    {variant: measurements} (see `measure`)."""
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, default=200, help="training steps per variant")
    args = parser.parse_args(argv)
    results, trained = {}, {}
    with harness.workdir(args) as runs:
        for name, kv_heads in VARIANTS.items():
            experiment = variant_experiment(kv_heads, args.steps, args.smoke)
            model, prompts, results[name] = train_variant(experiment, runs / name)
            trained[name] = model, prompts
            print(f"{name}: val loss {results[name]['val_loss']:.4f}", flush=True)
    new_tokens = 8 if args.smoke else experiment.model.max_len - PROMPT_LEN
    rounds = 1 if args.smoke else DECODE_ROUNDS
    for name, speeds in decode_rounds(trained, new_tokens, rounds).items():
        results[name].update(decode_tokens_per_s=statistics.median(speeds),
                             decode_tokens_per_s_rounds=speeds)
        print(f"{name}: decode tokens/s per round {[round(s) for s in speeds]}", flush=True)
    harness.publish(NAME, results, table=table(results), plot=lambda p: plot(results, p),
                    args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
