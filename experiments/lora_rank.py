"""LoRA rank 1, 2, 4, 8, 16 and 64 against full fine-tuning on code the base never saw.

    python experiments/lora_rank.py [--json PATH] [--base WORKDIR] [--steps 200] [--smoke]

Hu et al. 2021 (LoRA, Table 6) found that a very low rank suffices: adapting W_q and W_v with
r = 1 or 2 already matches r = 64 on GPT-3, because the update a downstream task needs has a
very low "intrinsic rank", and that LoRA then matches full fine-tuning, for a model adapted
to a task close to its pretraining. This script pretrains the default char GPT on the standard
library's code (or takes --base) and fine-tunes it on a package of it that the pretraining
never saw (`xml/`, as `peft_compare.py` does) with LoRA on the query and value projections at
each rank, and with full fine-tuning. As in the paper, alpha is fixed (16, the scale alpha/r)
rather than tuned per rank, and every rank gets the same learning rate, steps, batches and
seed. Writes experiments/results/lora_rank.{md,json,png}: trainable parameters, their fraction
of the model, the optimiser state's memory, validation loss and accuracy per rank, and loss
against rank.
"""

from __future__ import annotations

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

RANKS = (1, 2, 4, 8, 16, 64)
SMOKE_RANKS = (1, 2)  # the smoke model's projections are 32 wide
LORA_LEARNING_RATE = 2e-3
FULL_LEARNING_RATE = 3e-4  # peft_compare's rates


def lora(rank: int) -> PeftConfig:
    return LoraTuning(rank=rank, alpha=16.0, targets=("query", "value"))


def table(results: dict) -> str:
    rows = [[name, "-" if r.get("rank") is None else r["rank"], f"{r['trainable_params']:,}",
             f"{r['trainable_fraction']:.3%}", f"{r['optimizer_bytes'] / 2**20:.3f} MiB",
             f"{r['val_loss']:.4f}", f"{r['val_accuracy']:.3f}"]
            for name, r in results.items()]
    return harness.markdown_table(["run", "rank", "trainable params", "fraction",
                                   "optimiser memory", "val loss", "val accuracy"], rows)


def plot(results: dict, path: Path) -> None:
    """Left: validation loss against rank, with full fine-tuning and the frozen model as
    levels. Right: the validation curves."""
    fig, (left, right) = harness.plt.subplots(1, 2, figsize=(11, 4.5))
    ranked = [(r["rank"], r["val_loss"]) for r in results.values() if r.get("rank")]
    left.plot(*zip(*ranked, strict=True), marker="o", label="LoRA on q, v")
    for name, style in (("full", "-"), ("frozen", "--")):
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
                   "full": measure(full, runs / "full")}
        for rank in ranks:
            experiment = fine_tune_experiment(base, base_dir, f"lora_r{rank}", lora(rank),
                                              LORA_LEARNING_RATE, steps, args.smoke)
            results[f"lora_r{rank}"] = {"rank": rank, **measure(experiment, runs / f"r{rank}")}
            print(f"rank {rank}: val loss {results[f'lora_r{rank}']['val_loss']:.4f}", flush=True)
    harness.publish("lora_rank", results, table=table(results), plot=lambda p: plot(results, p),
                    args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
