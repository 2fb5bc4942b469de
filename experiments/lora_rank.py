"""LoRA rank 1, 4, 8 and 64 against full fine-tuning on code the base never saw.

    python experiments/lora_rank.py [--json PATH] [--base WORKDIR] [--steps 200] [--smoke]

Hu et al. 2021 (LoRA, Table 6) found that a very low rank suffices: adapting W_q and W_v with
r = 1 or 2 already matches r = 64 on GPT-3, because the update a downstream task needs has a
very low "intrinsic rank", and that LoRA then matches full fine-tuning, for a model adapted
to a task close to its pretraining. This script pretrains the default char GPT on the standard
library's code (or takes --base) and fine-tunes it on a package of it that the pretraining
never saw (`xml/`, as `peft_compare.py` does) with LoRA on the query and value projections at
each rank, and with full fine-tuning. As in the paper, alpha is fixed (16, the scale alpha/r)
rather than tuned per rank, and every rank gets the same learning rate, steps, batches and
seed. Two diagnostics of the gap to full fine-tuning: rank 8 at two more learning rates (a
3-point sweep), and a control that trains the base as long again on its own corpus with full
fine-tuning's settings and measures it on the new code (what more training alone gives).
Writes experiments/results/lora_rank.{md,json,png}: trainable parameters, their fraction of
the model, the optimiser state's memory, validation loss and accuracy per run, and loss
against rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import harness
from peft_compare import (
    FINE_TUNE_PACKAGE,
    add_base_arguments,
    draw_curves,
    fine_tune_experiment,
    measure,
    measure_frozen,
    pretrained_base,
)

from tfx.train.finetuning import FullTuning, LoraTuning, PeftConfig
from tfx.train.loop import train

RANKS = (1, 4, 8, 64)
SMOKE_RANKS = (1, 2)  # the smoke model's projections are 32 wide
LORA_LEARNING_RATE = 2e-3
FULL_LEARNING_RATE = 3e-4  # peft_compare's rates
SWEEP_RANK, SWEEP_RATES = 8, (6e-3, 2e-2)  # with LORA_LEARNING_RATE: a 3-point sweep


def lora(rank: int) -> PeftConfig:
    return LoraTuning(rank=rank, alpha=16.0, targets=("query", "value"))


def continued_pretraining(base, base_dir: Path, runs: Path, steps: int, smoke: bool) -> dict:
    """The control: the base trained `steps` more on its own corpus (the standard library
    without xml/) with full fine-tuning's settings, then measured on the fine-tuning corpus's
    validation files. It tells how much of full fine-tuning's gain is more training of an
    undertrained base rather than adaptation to the new code."""
    tuned = fine_tune_experiment(base, base_dir, "continued", FullTuning(), FULL_LEARNING_RATE,
                                 steps, smoke)
    train(dataclasses.replace(tuned, data=base.data), runs / "continued", progress=False)
    measured = fine_tune_experiment(base, runs / "continued", "continued", FullTuning(),
                                    FULL_LEARNING_RATE, steps, smoke)
    return measure_frozen(measured, runs / "continued_measured")


def table(results: dict) -> str:
    rows = [[name, "-" if r.get("rank") is None else r["rank"],
             "-" if r.get("learning_rate") is None else r["learning_rate"],
             f"{r['trainable_params']:,}",
             f"{r['trainable_fraction']:.3%}", f"{r['optimizer_bytes'] / 2**20:.3f} MiB",
             f"{r['val_loss']:.4f}", f"{r['val_accuracy']:.3f}"]
            for name, r in results.items()]
    return harness.markdown_table(["run", "rank", "learning rate", "trainable params",
                                   "fraction", "optimiser memory", "val loss", "val accuracy"],
                                  rows) + (
        "\ncontinued: the base trained as long again on its own corpus (no xml/ code) with full "
        "fine-tuning's settings, measured on xml/'s validation files (nothing trained on them; "
        "its trainable-parameter columns are those of a frozen model on xml/).\n")


def plot(results: dict, path: Path) -> None:
    """Left: validation loss against rank, with full fine-tuning and the frozen model as
    levels. Right: the validation curves."""
    fig, (left, right) = harness.plt.subplots(1, 2, figsize=(11, 4.5))
    ranked = [(r["rank"], r["val_loss"]) for r in results.values()
              if r.get("rank") and r["learning_rate"] == LORA_LEARNING_RATE]
    left.plot(*zip(*ranked, strict=True), marker="o", label="LoRA on q, v")
    for name, style in (("full", "-"), ("continued", ":"), ("frozen", "--")):
        left.axhline(results[name]["val_loss"], color="gray", linestyle=style, label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("LoRA rank r")
    left.set_ylabel("validation loss (nats/byte)")
    left.legend()
    draw_curves(right, results, title=f"Fine-tuning char GPT on unseen stdlib code "
                                      f"({FINE_TUNE_PACKAGE}/)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    add_base_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", help=f"default {RANKS}")
    args = parser.parse_args(argv)
    steps = 2 if args.smoke else args.steps
    ranks = args.ranks or (SMOKE_RANKS if args.smoke else RANKS)
    with harness.workdir(args) as runs:
        base, base_dir = pretrained_base(args, runs)
        full = fine_tune_experiment(base, base_dir, "full", FullTuning(),
                                    FULL_LEARNING_RATE, steps, args.smoke)
        results = {"frozen": measure_frozen(full, runs / "frozen"),
                   "full": {"learning_rate": FULL_LEARNING_RATE,
                            **measure(full, runs / "full")}}
        results["continued"] = continued_pretraining(base, base_dir, runs, steps, args.smoke)
        sweep = [(SMOKE_RANKS[0] if args.smoke else SWEEP_RANK, rate) for rate in SWEEP_RATES]
        for rank, rate in [(rank, LORA_LEARNING_RATE) for rank in ranks] + sweep:
            name = f"lora_r{rank}" + ("" if rate == LORA_LEARNING_RATE else f"_lr{rate:g}")
            experiment = fine_tune_experiment(base, base_dir, name, lora(rank), rate, steps,
                                              args.smoke)
            results[name] = {"rank": rank, "learning_rate": rate,
                             **measure(experiment, runs / name)}
            print(f"{name}: val loss {results[name]['val_loss']:.4f}", flush=True)
    harness.publish("lora_rank", results, table=table(results), plot=lambda p: plot(results, p),
                    args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
