"""Masked-LM pretraining of a small BERT with BERT's own recipe, post-norm (as BERT) and pre-norm
side by side: does it leave the unigram plateau?

    python experiments/bert_mlm.py [--steps 400] [--json PATH] [--workdir DIR] [--out DIR]
        [--smoke]

Trains `bert_mlm` (4 layers, width 256, byte-level, on the standard library's source, batches
of 32 x 128 bytes) with the optimiser settings of Devlin et al. 2019 (appendix A.2): peak
learning rate 1e-4 reached by linear warmup over the first 1% of the steps, Adam with
beta2 = 0.999, weight decay 0.01, gradients clipped at norm 1. The one thing scaled down is the
length: --steps instead of 10^6, the warmup share kept at 1%; tfx's schedule then decays by a
cosine to a tenth of the peak where BERT decays linearly to zero. Two runs, alike but for the
norm placement: post-norm (BERT's, `norm.pre_norm=False`) and pre-norm. Every eighth of the
steps, and at the initialisation, measures masked-token accuracy and loss on the fixed
validation batches. Baseline: always predicting the validation text's most frequent byte
(the unigram plateau, where an MLM first settles).

Paper: Devlin et al. 2019 (BERT: the masked-LM objective learns bidirectional context, so
masked accuracy rises far above the unigram baseline); Xiong et al. 2020 (post-norm needs a
warmup and a small learning rate, pre-norm much less). Writes
experiments/results/bert_mlm.{md,json,png}.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import harness
import numpy as np

from tfx.train.config import Experiment
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer
from tfx.train.objectives import get_objective

NAME = "bert_mlm"
CHECKPOINTS = 8  # measured points along training, besides the initialisation
RUNS = {"post_norm": False, "pre_norm": True}  # name -> norm.pre_norm
WARMUP_SHARE = 0.01  # BERT: 10,000 of 10^6 steps
SMOKE_STEPS = 2
SMOKE_MODEL = dict(d_model=32, num_heads=2, d_ff=64, num_layers=1)


def bert_recipe(steps: int, pre_norm: bool) -> Experiment:
    """`bert_mlm` with BERT's optimiser settings for `steps` steps and the given norm placement,
    evaluated on 4 batches of 32 (half the default: 9 evaluations on 8 batches would cost about
    30 training steps)."""
    bert = get_experiment("bert_mlm")
    optim = dataclasses.replace(bert.optim, learning_rate=1e-4, b1=0.9, b2=0.999,
                                weight_decay=0.01, grad_clip=1.0,
                                warmup_steps=max(1, round(WARMUP_SHARE * steps)))
    return dataclasses.replace(
        bert, name=f"{NAME}_{'pre' if pre_norm else 'post'}_norm", optim=optim,
        model=bert.model.replace(norm={"pre_norm": pre_norm}),
        train=dataclasses.replace(bert.train, eval_batches=4))


def most_frequent_byte(experiment: Experiment) -> tuple[str, float]:
    """The most frequent byte of the validation batches' text and its share of their real,
    non-special tokens: the expected masked accuracy of always predicting it (masking picks
    those tokens uniformly)."""
    c, feed = experiment.model, get_objective(experiment.objective).batches(experiment)
    t = c.special_tokens
    specials = [t.pad_id, t.cls_id, t.sep_id, t.mask_id]
    ids = np.concatenate([b["input_ids"][b["attention_mask"]] for b in feed.validation()])
    counts = np.bincount(ids[~np.isin(ids, specials)])
    return feed.tokenizer.decode([counts.argmax()]), float(counts.max() / counts.sum())


def left_plateau(curve: list[list], chance: float) -> int | None:
    """The first measured step whose masked accuracy is above `chance` by more than 0.01, and
    stays so at every later measurement; None if there is none."""
    above = [accuracy > chance + 0.01 for _, accuracy in curve]
    for i in range(len(curve)):
        if all(above[i:]):
            return curve[i][0]
    return None


def run(experiment: Experiment, workdir: Path) -> dict:
    """Train the BERT and measure masked-token accuracy along training."""
    trained = harness.train_measured(experiment, workdir)
    points = harness.measure_checkpoints(experiment, workdir, Trainer.evaluate)
    _, chance = most_frequent_byte(experiment)
    curve = [[p["step"], p["accuracy"]] for p in points]
    optim = experiment.optim
    return {"steps": experiment.train.steps, "pre_norm": experiment.model.norm.pre_norm,
            "learning_rate": optim.learning_rate, "warmup_steps": optim.warmup_steps,
            "tokens_per_s": trained["tokens_per_s"], "curve": curve,
            "loss_curve": [[p["step"], p["loss"]] for p in points],
            "final_masked_accuracy": points[-1]["accuracy"], "val_loss": points[-1]["loss"],
            "left_plateau_at": left_plateau(curve, chance)}


def table(results: dict) -> str:
    """The summary, then both runs along training: every number of `results`."""
    byte, chance = results["most_frequent_byte"], results["chance_accuracy"]
    summary = [[name, "pre" if r["pre_norm"] else "post", r["steps"], r["learning_rate"],
                r["warmup_steps"], f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "n/a",
                f"{r['val_loss']:.3f}", f"{r['final_masked_accuracy']:.3f}",
                r["left_plateau_at"] or "never"]
               for name, r in results.items() if name in RUNS]
    rows = [[step, *(f"{results[name][key][i][1]:.3f}" for name in RUNS
                     for key in ("loss_curve", "curve"))]
            for i, (step, _) in enumerate(results["post_norm"]["curve"])]
    return "\n".join([
        harness.markdown_table(
            ["run", "norm", "steps", "peak lr", "warmup steps", "train tokens/s", "val loss",
             "masked accuracy", "left the plateau at step"], summary),
        f"Baseline: always predicting the most frequent byte {byte!r} scores {chance:.3f}; "
        "leaving the plateau: masked accuracy above that by more than 0.01 at this and every "
        "later measurement.\n",
        harness.markdown_table(
            ["step", *(f"{name} {label}" for name in RUNS
                       for label in ("val loss", "masked accuracy"))], rows)])


def plot(results: dict, path: Path) -> None:
    """Masked accuracy and validation loss of both runs against the step."""
    fig, (accuracy_ax, loss_ax) = harness.plt.subplots(1, 2, figsize=(11, 4.5))
    for name in RUNS:
        accuracy_ax.plot(*zip(*results[name]["curve"], strict=True), marker="o", label=name)
        loss_ax.plot(*zip(*results[name]["loss_curve"], strict=True), marker="o", label=name)
    accuracy_ax.axhline(results["chance_accuracy"], color="gray", linestyle="--",
                        label=f"most frequent byte {results['most_frequent_byte']!r}")
    accuracy_ax.set(xlabel="training step", ylabel="masked accuracy (validation)",
                    title="BERT masked LM, BERT's recipe")
    loss_ax.set(xlabel="training step", ylabel="masked-token loss (validation, nats)")
    for ax in (accuracy_ax, loss_ax):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, default=400, help="training steps of each run")
    args = parser.parse_args(argv)
    steps = SMOKE_STEPS if args.smoke else args.steps
    runs = {name: harness.checkpointed(bert_recipe(steps, pre_norm), steps,
                                       points=CHECKPOINTS, smoke=args.smoke,
                                       smoke_model=SMOKE_MODEL)
            for name, pre_norm in RUNS.items()}
    byte, chance = most_frequent_byte(runs["post_norm"])
    results = {"most_frequent_byte": byte, "chance_accuracy": chance}
    with harness.workdir(args) as workdir:
        for name, experiment in runs.items():
            results[name] = run(experiment, workdir / name)
            print(f"{name}: masked accuracy {results[name]['final_masked_accuracy']:.3f}",
                  flush=True)
    harness.publish(NAME, results, table=table(results),
                    plot=functools.partial(plot, results), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
