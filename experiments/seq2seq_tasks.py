"""An encoder–decoder learning to reverse strings and to add numbers, with the sum written
most significant digit first (as people write it) and least significant digit first: the
cross-attention learns, and the digit order decides whether addition is learned.

    python experiments/seq2seq_tasks.py [--reverse-steps 600] [--addition-steps 1600]
        [--json PATH] [--workdir DIR] [--out DIR] [--smoke]

Trains `seq2seq_reverse` (2 + 2 layers, width 128, sinusoidal positions added to token
embeddings scaled by sqrt(d_model), as in Vaswani et al.) on 4..16 random letters -> the
letters reversed, and the same model (`seq2seq_addition`) on "a+b" -> the decimal sum, with a
and b of 2..8 digits together, once with the answer written as usual (task `addition`) and once
reversed (task `addition_reversed`, the same sums). Every run is checkpointed at every eighth
of its steps and measured there and at the initialisation: token accuracy and whole-sequence
exact match under teacher forcing on the validation batches (what `tfx eval` reports), and the
exact match of greedy decoding (`tfx.generation.generate`, stopped at EOS) on 512 held-out
examples, compared with the task's own answer: on all of them, and on those that no training
batch held (short sums recur in training). Baseline: the untrained model (step 0).

Papers: Vaswani et al. 2017 / Sutskever et al. 2014 (an encoder–decoder maps a sequence to
another through attention; reversal is the classic test, solved exactly); Lee et al. 2023
(Teaching Arithmetic to Small Transformers: written least significant digit first, each digit
of a sum depends only on two digits of the operands and the carry just written, and small
transformers learn addition far sooner than with the usual order, which asks for every carry
before the first digit). Writes experiments/results/seq2seq_tasks.{md,json,png}.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import harness
import numpy as np

from tfx.generation import generate
from tfx.train.config import Experiment
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer
from tfx.train.objectives import get_objective
from tfx.train.tasks import SyntheticTask

NAME = "seq2seq_tasks"
PARTS = ("reverse", "addition", "addition_reversed")
CHECKPOINTS = 8  # measured points along training, besides the initialisation
HELD_OUT = 512  # greedy-decoded examples per measurement
# Held-out examples come from a seed that neither training (train.seed = 0) nor the
# validation batches (seed 1_000_003) use.
HELD_OUT_SEED = 7_777_777
SMOKE_STEPS = 2
SMOKE_MODEL = dict(d_model=32, num_heads=2, d_ff=64, num_layers=1)


def experiments() -> dict[str, Experiment]:
    """part -> its run: `seq2seq_reverse`, `seq2seq_addition` (the same model adding 2- to
    8-digit numbers), and that with the answers reversed."""
    addition = get_experiment("seq2seq_addition")
    reversed_data = dataclasses.replace(addition.data, task="addition_reversed")
    return {"reverse": get_experiment("seq2seq_reverse"), "addition": addition,
            "addition_reversed": dataclasses.replace(addition, data=reversed_data)}


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
    points = harness.measure_checkpoints(experiment, workdir, functools.partial(
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
    """The summary and every measured checkpoint of each part: every number of `results`."""
    speed = "n/a: fewer than 2 logged steps"
    unseen = "n/a: every held-out example was seen in training"
    summary, checkpoint_rows = [], []
    for part in PARTS:
        r, task = results[part], results[part]["task"]
        start = r["checkpoints"][0]
        kind = "letters" if part == "reverse" else "digits"
        summary.append([f"{part} ({task['min_len']}..{task['max_len']} {kind})", r["steps"],
                        fmt(r["tokens_per_s"], speed), fmt(r["val_loss"]),
                        fmt(r["token_accuracy"]),
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
            ["part", "steps", "train tokens/s", "val loss", "val token accuracy",
             f"greedy exact match ({held_out} held-out)", "baseline",
             "held-out seen in training"], summary),
        "Along training (val loss includes label smoothing 0.1; token accuracy and "
        "teacher-forced exact match on the validation batches, greedy exact match on the "
        "held-out examples):\n",
        harness.markdown_table(
            ["task", "step", "val loss", "token accuracy", "teacher-forced exact match",
             "greedy exact match", "greedy exact match, unseen in training"],
            checkpoint_rows)])


def plot(results: dict, path: Path) -> None:
    """One panel per part: token accuracy and exact matches against the training step."""
    fig, axes = harness.plt.subplots(1, len(PARTS), figsize=(5 * len(PARTS), 4.5))
    for ax, part in zip(axes, PARTS, strict=True):
        points = results[part]["checkpoints"]
        steps = [p["step"] for p in points]
        for key, label in (("token_accuracy", "token accuracy (teacher-forced)"),
                           ("teacher_forced_exact_match", "exact match (teacher-forced)"),
                           ("exact_match", "exact match (greedy, held-out)"),
                           ("exact_match_unseen", "exact match (greedy, unseen in training)")):
            ax.plot(steps, [np.nan if p[key] is None else p[key] for p in points], marker="o",
                    label=label)
        ax.set_title(f"encoder-decoder: {part}")
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--reverse-steps", type=int, default=600,
                        help="seq2seq_reverse training steps")
    parser.add_argument("--addition-steps", type=int, default=1600,
                        help="training steps of each addition run")
    args = parser.parse_args(argv)
    steps = {"reverse": args.reverse_steps, "addition": args.addition_steps,
             "addition_reversed": args.addition_steps}
    runs = {part: harness.checkpointed(
                experiment, SMOKE_STEPS if args.smoke else steps[part], points=CHECKPOINTS,
                smoke=args.smoke, smoke_model=SMOKE_MODEL)
            for part, experiment in experiments().items()}
    held_out = 32 if args.smoke else HELD_OUT
    with harness.workdir(args) as workdir:
        results = {part: run_seq2seq(runs[part], workdir / part, held_out) for part in PARTS}
    harness.publish(NAME, results, table=table(results),
                    plot=functools.partial(plot, results), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
