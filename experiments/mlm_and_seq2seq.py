"""Masked-LM pretraining of a small BERT, and an encoder–decoder learning to reverse strings and
to add numbers: the objectives and the cross-attention learn.

    python experiments/mlm_and_seq2seq.py [--mlm-steps 400] [--reverse-steps 600]
        [--addition-steps 800] [--json PATH] [--workdir DIR] [--out DIR] [--smoke]

Trains three runs from the named experiments of `tfx train`, checkpointing every eighth of the
steps, then measures every checkpoint and the initialisation (step 0):
- mlm: `bert_mlm` (4 layers, width 256, byte-level, on the standard library's source), for
  --mlm-steps (its own 400 by default): masked-token accuracy and loss on the fixed
  validation batches. Baseline: always predicting the validation text's most frequent byte.
- reverse: `seq2seq_reverse` (2 + 2 layers, width 128, sinusoidal positions added to token
  embeddings scaled by sqrt(d_model), as in Vaswani et al.) on 4..16 random
  letters -> the letters reversed;
- addition: the same model on "a+b" -> the decimal sum, with a and b of 2..8 digits together.
  For both: token accuracy and whole-sequence exact match under teacher forcing on the
  validation batches (what `tfx eval` reports), and the exact match of greedy decoding
  (`tfx.generation.generate`, stopped at EOS) on 512 held-out examples, compared with the
  task's own answer: on all of them, and on those that no training batch held (short sums
  recur in training). Baseline: the untrained model (step 0).

Papers: Devlin et al. 2019 (BERT: the masked-LM objective learns bidirectional context);
Vaswani et al. 2017 / Sutskever et al. 2014 (an encoder–decoder maps a sequence to another
through attention; reversal is the classic test, solved exactly). Writes
experiments/results/mlm_and_seq2seq.{md,json,png}.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import harness
import numpy as np

from tfx.generation import generate
from tfx.train.config import Experiment
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer
from tfx.train.objectives import get_objective
from tfx.train.tasks import SyntheticTask

NAME = "mlm_and_seq2seq"
CHECKPOINTS = 8  # measured points along training, besides the initialisation
HELD_OUT = 512  # greedy-decoded examples per measurement
# Held-out examples come from a seed that neither training (train.seed = 0) nor the
# validation batches (seed 1_000_003) use.
HELD_OUT_SEED = 7_777_777
SMOKE_STEPS = 2
SMOKE_MODEL = dict(d_model=32, num_heads=2, d_ff=64, num_layers=1)


def experiments() -> dict[str, Experiment]:
    """The three runs at their full length: `bert_mlm` evaluated on 4 batches of 32 (half the
    default: its 9 evaluations on 8 batches would cost about 30 training steps),
    `seq2seq_reverse` and `seq2seq_addition` (the same model adding 2- to 8-digit numbers)."""
    bert = get_experiment("bert_mlm")
    return {"mlm": dataclasses.replace(bert, train=dataclasses.replace(bert.train,
                                                                       eval_batches=4)),
            "reverse": get_experiment("seq2seq_reverse"),
            "addition": get_experiment("seq2seq_addition")}


def shortened(experiment: Experiment, steps: int, *, smoke: bool) -> Experiment:
    """`experiment` for `steps` steps, checkpointed every 1/CHECKPOINTS of them (all kept),
    evaluated by the loop at the end only (the checkpoints are measured afterwards). Warmup is
    capped at a fifth of the steps. Smoke: a one-layer width-32 model, 4-row batches."""
    every = max(1, steps // CHECKPOINTS)
    train = dataclasses.replace(experiment.train, steps=steps)
    if smoke:
        train = harness.smoke_train(train, steps=steps)
    train = dataclasses.replace(
        train, checkpoint_every=every, keep_checkpoints=steps // every + 1, eval_every=steps)
    optim = dataclasses.replace(experiment.optim,
                                warmup_steps=min(experiment.optim.warmup_steps, steps // 5))
    model = experiment.model.replace(**SMOKE_MODEL) if smoke else experiment.model
    return dataclasses.replace(experiment, model=model, train=train, optim=optim)


def measure_checkpoints(experiment: Experiment, workdir: Path,
                        measure: Callable[[Trainer], dict]) -> list[dict]:
    """[{"step": s, **measure(trainer)}] for the initialisation (s = 0) and every checkpoint
    of the finished run in `workdir`, oldest first."""
    trainer = Trainer(experiment, workdir)
    try:
        points = [{"step": 0, **measure(trainer)}]
        for step in trainer.checkpoints.all_steps():
            _, values = trainer.checkpoints.restore(trainer.state.to_dict(), step=step)
            trainer.state = dataclasses.replace(trainer.state, **values)
            points.append({"step": step, **measure(trainer)})
    finally:
        trainer.close()
    return points


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


def run_mlm(experiment: Experiment, workdir: Path) -> dict:
    """Train the BERT and measure masked-token accuracy along training."""
    trained = harness.train_measured(experiment, workdir)
    points = measure_checkpoints(experiment, workdir, Trainer.evaluate)
    byte, share = most_frequent_byte(experiment)
    return {"steps": experiment.train.steps, "tokens_per_s": trained["tokens_per_s"],
            "curve": [[p["step"], p["accuracy"]] for p in points],
            "loss_curve": [[p["step"], p["loss"]] for p in points],
            "final_masked_accuracy": points[-1]["accuracy"], "val_loss": points[-1]["loss"],
            "most_frequent_byte": byte, "chance_accuracy": share}


def source_texts(task: SyntheticTask, batch: dict) -> list[str]:
    """The source strings of a task batch ("abc", "12+345")."""
    return [task.tokenizer.decode(ids[mask])
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def greedy_correct(trainer: Trainer, examples: dict) -> np.ndarray:
    """bool [N]: whether the greedy decoding of each of `examples` (a task batch), up to EOS,
    is exactly the task's answer to its source string."""
    task = trainer.feed.task
    generated = generate(trainer.model(), examples["input_ids"],
                         attention_mask=examples["attention_mask"],
                         max_new_tokens=task.target_len, temperature=0.0,
                         eos_token_id=task.eos_id, pad_token_id=task.pad_id)
    decoded = [task.decode_target(row[1:]) for row in np.asarray(generated)]  # after BOS
    expected = [task.answer(text) for text in source_texts(task, examples)]
    return np.array([d == e for d, e in zip(decoded, expected, strict=True)])


def seq2seq_metrics(trainer: Trainer, examples: dict, unseen: np.ndarray) -> dict:
    """Teacher-forced validation metrics, and the greedy exact match on `examples`: on all of
    them, and on those that no training batch holds (`unseen`, bool [N])."""
    validation = trainer.evaluate()
    correct = greedy_correct(trainer, examples)
    return {"val_loss": validation["loss"], "token_accuracy": validation["accuracy"],
            "teacher_forced_exact_match": validation["exact_match"],
            "exact_match": float(correct.mean()),
            "exact_match_unseen": float(correct[unseen].mean()) if unseen.any() else None}


def seen_in_training(experiment: Experiment, sources: list[str]) -> np.ndarray:
    """bool [len(sources)]: whether some training batch of `experiment` holds each source."""
    feed = get_objective(experiment.objective).batches(experiment)
    seen = {text for step in range(experiment.train.steps)
            for text in source_texts(feed.task, feed.train(step))}
    return np.array([text in seen for text in sources])


def run_seq2seq(experiment: Experiment, workdir: Path, held_out: int) -> dict:
    """Train the encoder–decoder on its task; measure teacher-forced and greedy accuracy along
    training on `held_out` examples."""
    trained = harness.train_measured(experiment, workdir)
    data = experiment.data
    task = SyntheticTask(data.task, data.min_len, data.max_len)
    examples = task.batch(0, held_out, seed=HELD_OUT_SEED)
    seen = seen_in_training(experiment, source_texts(task, examples))
    points = measure_checkpoints(experiment, workdir, functools.partial(
        seq2seq_metrics, examples=examples, unseen=~seen))
    final = points[-1]
    return {"task": {"name": data.task, "min_len": data.min_len, "max_len": data.max_len},
            "steps": experiment.train.steps, "tokens_per_s": trained["tokens_per_s"],
            "exact_match": final["exact_match"], "exact_match_unseen": final["exact_match_unseen"],
            "token_accuracy": final["token_accuracy"],
            "teacher_forced_exact_match": final["teacher_forced_exact_match"],
            "val_loss": final["val_loss"], "held_out_examples": held_out,
            "held_out_seen_in_training": float(seen.mean()),
            "curve": [[p["step"], p["token_accuracy"]] for p in points],
            "exact_match_curve": [[p["step"], p["exact_match"]] for p in points],
            "checkpoints": points}


def fmt(value: float | None, missing: str = "n/a") -> str:
    """A rate or loss to 3 decimals; `missing` for None."""
    return missing if value is None else f"{value:.3f}"


def table(results: dict) -> str:
    """The summary, the MLM curve and the seq2seq checkpoints, every number of `results`."""
    mlm = results["mlm"]
    speed = "n/a: fewer than 2 logged steps"
    unseen = "n/a: every held-out example was seen in training"
    summary = [["mlm (bert_mlm, masked bytes of stdlib source)", mlm["steps"],
                fmt(mlm["tokens_per_s"], speed), fmt(mlm["val_loss"]),
                f"masked {fmt(mlm['final_masked_accuracy'])}",
                "n/a: MLM predicts single masked bytes, not sequences",
                f"most frequent byte {mlm['most_frequent_byte']!r}: "
                f"{fmt(mlm['chance_accuracy'])}; step 0: {fmt(mlm['curve'][0][1])}",
                "n/a: validation text is a held-out slice of the corpus files"]]
    checkpoint_rows = []
    for part in ("reverse", "addition"):
        r, task = results[part], results[part]["task"]
        start = r["checkpoints"][0]
        summary.append([f"{part} ({task['min_len']}..{task['max_len']} "
                        f"{'digits' if part == 'addition' else 'letters'})", r["steps"],
                        fmt(r["tokens_per_s"], speed), fmt(r["val_loss"]),
                        f"token {fmt(r['token_accuracy'])}",
                        f"{fmt(r['exact_match'])} (unseen {fmt(r['exact_match_unseen'], unseen)}"
                        f"; teacher-forced {fmt(r['teacher_forced_exact_match'])})",
                        f"step 0: exact {fmt(start['exact_match'])}, token "
                        f"{fmt(start['token_accuracy'])}",
                        fmt(r["held_out_seen_in_training"])])
        checkpoint_rows += [[part, p["step"], fmt(p["val_loss"]), fmt(p["token_accuracy"]),
                             fmt(p["teacher_forced_exact_match"]), fmt(p["exact_match"]),
                             fmt(p["exact_match_unseen"], unseen)] for p in r["checkpoints"]]
    held_out = results["reverse"]["held_out_examples"]
    return "\n".join([
        harness.markdown_table(
            ["part", "steps", "train tokens/s", "val loss", "val accuracy",
             f"greedy exact match ({held_out} held-out)", "baseline",
             "held-out seen in training"], summary),
        "Masked-LM validation along training:\n",
        harness.markdown_table(
            ["step", "val loss", "masked accuracy"],
            [[step, fmt(loss), fmt(accuracy)] for (step, loss), (_, accuracy)
             in zip(mlm["loss_curve"], mlm["curve"], strict=True)]),
        "Encoder-decoder along training (val loss includes label smoothing 0.1; token accuracy "
        "and teacher-forced exact match on the validation batches, greedy exact match on the "
        "held-out examples):\n",
        harness.markdown_table(
            ["task", "step", "val loss", "token accuracy", "teacher-forced exact match",
             "greedy exact match", "greedy exact match, unseen in training"],
            checkpoint_rows)])


def plot(results: dict, path: Path) -> None:
    """Three panels: masked accuracy (with the most-frequent-byte line), then token accuracy
    and exact matches of each seq2seq task, against the training step."""
    fig, axes = harness.plt.subplots(1, 3, figsize=(15, 4.5))
    mlm = results["mlm"]
    axes[0].plot(*zip(*mlm["curve"], strict=True), marker="o", label="masked accuracy")
    axes[0].axhline(mlm["chance_accuracy"], color="gray", linestyle="--",
                    label=f"most frequent byte {mlm['most_frequent_byte']!r}")
    axes[0].set_title("BERT masked LM (validation)")
    for ax, part in zip(axes[1:], ("reverse", "addition"), strict=True):
        points = results[part]["checkpoints"]
        steps = [p["step"] for p in points]
        for key, label in (("token_accuracy", "token accuracy (teacher-forced)"),
                           ("teacher_forced_exact_match", "exact match (teacher-forced)"),
                           ("exact_match", "exact match (greedy, held-out)"),
                           ("exact_match_unseen", "exact match (greedy, unseen in training)")):
            ax.plot(steps, [np.nan if p[key] is None else p[key] for p in points], marker="o",
                    label=label)
        ax.set_title(f"encoder-decoder: {part}")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--mlm-steps", type=int, default=400, help="bert_mlm training steps")
    parser.add_argument("--reverse-steps", type=int, default=600,
                        help="seq2seq_reverse training steps")
    parser.add_argument("--addition-steps", type=int, default=800,
                        help="addition training steps")
    args = parser.parse_args(argv)
    steps = {"mlm": args.mlm_steps, "reverse": args.reverse_steps,
             "addition": args.addition_steps}
    runs = {part: shortened(experiment, SMOKE_STEPS if args.smoke else steps[part],
                            smoke=args.smoke) for part, experiment in experiments().items()}
    held_out = 32 if args.smoke else HELD_OUT
    with harness.workdir(args) as workdir:
        results = {"mlm": run_mlm(runs["mlm"], workdir / "mlm")}
        for part in ("reverse", "addition"):
            results[part] = run_seq2seq(runs[part], workdir / part, held_out)
    harness.publish(NAME, results, table=table(results),
                    plot=functools.partial(plot, results), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
