"""Fine-tuning methods compared at equal steps: full, LoRA (two inits), soft prompt, prefix,
adapters, and the frozen model.

    python experiments/peft_compare.py [--json PATH] [--base WORKDIR] [--steps 200] [--smoke]

Pretrains the default char GPT (`tfx train gpt_char`, 300 steps on the standard library's code)
or takes the run at --base, then fine-tunes it on code the pretraining never saw but whose kind
it knows, as the LoRA paper adapts a model to a task close to its pretraining: the standard
library's `xml` package (22 files, 0.3 MB), which the embedded corpus leaves out (it comes after
the corpus's 8 MB cut-off in path order; the script checks that no file of it was seen), with
3 of its files held out for validation. Every
method gets the same steps, batches and schedule; each its own learning rate, fixed beforehand
(PEFT methods are usually trained at higher rates than full fine-tuning). Writes
experiments/results/peft_compare.{md,json,png} (--out): trainable parameters, their fraction of
the model, optimiser memory, final validation loss and step time, and the loss curves.
`lora_rank.py` reuses the pretraining and fine-tuning set-up defined here.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import harness
import jax

from tfx.train.config import DataConfig, OptimConfig, PeftConfig, TrainConfig
from tfx.train.data import stdlib_texts
from tfx.train.experiments import get_experiment
from tfx.train.finetuning import peft_config
from tfx.train.loop import Trainer, train

# method -> (PeftConfig settings, learning rate)
METHODS = {
    "full": (dict(method="full"), 3e-4),
    "lora": (dict(method="lora", rank=8, alpha=16.0, targets=("query", "value")), 2e-3),
    "lora_seed_init": (dict(method="lora", rank=8, alpha=16.0, targets=("query", "value"),
                            init_style="seed"), 2e-3),
    "prompt": (dict(method="prompt", num_tokens=16, init="vocab"), 3e-2),
    "prefix": (dict(method="prefix", num_tokens=16), 1e-2),
    "adapter": (dict(method="adapter", size=16, placement="houlsby"), 2e-3),
}


FINE_TUNE_PACKAGE = "xml"
FINE_TUNE_VAL_FRACTION = 0.15  # 3 of the 22 files: 32 KB, two validation passes' worth


def fine_tune_corpus() -> str:
    """The folder of FINE_TUNE_PACKAGE in the standard library.

    Raises:
      RuntimeError: when the pretraining corpus (`stdlib_texts`) holds a file of it, as it may
        on another Python version; the comparison would no longer be on unseen code.
    """
    seen = [rel for rel, _ in stdlib_texts() if rel.startswith(f"{FINE_TUNE_PACKAGE}/")]
    if seen:
        raise RuntimeError(f"the pretraining corpus holds {len(seen)} files of "
                           f"{FINE_TUNE_PACKAGE}/ (e.g. {seen[0]}); pick another package")
    return str(Path(sysconfig.get_paths()["stdlib"]) / FINE_TUNE_PACKAGE)


def base_experiment(smoke: bool):
    e = get_experiment("gpt_char")
    if not smoke:
        return e
    model = e.model.replace(d_model=32, num_heads=2, attention={"num_kv_heads": None}, d_ff=64,
                            num_layers=1)
    return dataclasses.replace(e, model=model, train=TrainConfig(
        steps=3, batch_size=4, seq_len=32, eval_every=3, eval_batches=1, checkpoint_every=3))


def pretrained_base(args, runs: Path) -> tuple:
    """(the base experiment, the workdir of its trained run: args.base or trained here)."""
    base = base_experiment(args.smoke)
    if args.base is not None:
        return base, args.base
    train(base, runs / "base", progress=not args.smoke)
    return base, runs / "base"


def fine_tune_experiment(base, base_dir: Path, name: str, peft: PeftConfig,
                         learning_rate: float, steps: int, smoke: bool):
    """`base` fine-tuned from the run in `base_dir` on `fine_tune_corpus()` with `peft`."""
    train_config = dataclasses.replace(
        base.train, steps=steps, init_from=str(base_dir), log_every=1 if smoke else 10,
        eval_every=steps if smoke else 50, checkpoint_every=steps)
    return dataclasses.replace(
        base, name=f"peft_{name}", train=train_config, peft=peft,
        data=DataConfig(source=fine_tune_corpus(), val_fraction=FINE_TUNE_VAL_FRACTION),
        optim=OptimConfig(learning_rate=learning_rate, warmup_steps=min(20, steps)))


def parameter_counts(experiment, workdir: Path) -> dict:
    """Trainable parameters, their fraction of the model and their optimiser state's bytes."""
    trainer = Trainer(experiment, workdir)
    state = trainer.state
    trainable = sum(x.size for x in jax.tree.leaves(state.params))
    total = trainable + sum(x.size for x in jax.tree.leaves(state.frozen))
    trainer.close()
    return {"trainable_params": int(trainable), "trainable_fraction": trainable / total,
            "optimizer_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.opt_state)))}


def measure(experiment, workdir: Path) -> dict:
    """parameter_counts, then harness.train_measured."""
    counts = parameter_counts(experiment, workdir)  # builds the state, trains nothing
    return {**counts, **harness.train_measured(experiment, workdir)}


def measure_frozen(experiment, workdir: Path) -> dict:
    """The base model's validation metrics on the fine-tuning corpus, untrained."""
    trainer = Trainer(experiment, workdir)
    validation = trainer.evaluate()
    trainer.close()
    return {"trainable_params": 0, "trainable_fraction": 0.0, "optimizer_bytes": 0,
            "val_loss": validation["loss"], "val_accuracy": validation["accuracy"],
            "step_seconds": None, "curve": []}


def table(results: dict) -> str:
    rows = [[method, f"{r['trainable_params']:,}", f"{r['trainable_fraction']:.3%}",
             f"{r['optimizer_bytes'] / 2**20:.2f} MiB", f"{r['val_loss']:.4f}",
             f"{r['val_accuracy']:.3f}",
             "-" if r["step_seconds"] is None else f"{r['step_seconds']:.3f}"]
            for method, r in results.items()]
    return harness.markdown_table(["method", "trainable params", "fraction", "optimiser memory",
                                   "val loss", "val accuracy", "s/step"], rows)


def draw_curves(ax, results: dict, *, title: str) -> None:
    """Validation loss against fine-tuning step on `ax`, one line per entry (a level line for
    an entry without a curve)."""
    for name, r in results.items():
        if r["curve"]:
            steps, losses = zip(*r["curve"], strict=True)
            ax.plot(steps, losses, marker="o", label=name)
        else:
            ax.axhline(r["val_loss"], color="gray", linestyle="--", label=name)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title)
    ax.legend()


def plot(results: dict, path: Path) -> None:
    fig, ax = harness.plt.subplots(figsize=(7, 4.5))
    draw_curves(ax, results, title=f"Fine-tuning char GPT on unseen stdlib code "
                                   f"({FINE_TUNE_PACKAGE}/)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_base_arguments(parser) -> None:
    parser.add_argument("--base", type=Path, help="a trained gpt_char workdir to start from")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per run")


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    add_base_arguments(parser)
    args = parser.parse_args(argv)
    steps = 2 if args.smoke else args.steps
    with harness.workdir(args) as runs:
        base, base_dir = pretrained_base(args, runs)

        def experiment(method):
            settings, learning_rate = METHODS.get(method, (dict(method="full"), 3e-4))
            return fine_tune_experiment(base, base_dir, method, peft_config(**settings),
                                        learning_rate, steps, args.smoke)

        results = {"frozen": measure_frozen(experiment("frozen"), runs / "frozen")}
        for method in METHODS:
            results[method] = measure(experiment(method), runs / method)
            print(f"{method}: val loss {results[method]['val_loss']:.4f}", flush=True)
    harness.publish("peft_compare", results, table=table(results),
                    plot=lambda path: plot(results, path), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
