"""Fine-tuning methods compared at equal steps: full, LoRA (two inits), soft prompt, prefix,
adapters, and the frozen model.

    python experiments/peft_compare.py [--json PATH] [--base WORKDIR] [--steps 200] [--smoke]

Pretrains the default char GPT (`tfx train gpt_char`, 300 steps on the standard library's code)
or takes the run at --base, then fine-tunes it on a slice the pretraining never saw: the
standard library's `pydoc_data/topics.py`, English documentation held in a Python file. Every
method gets the same steps, batches and schedule; each its own learning rate, fixed beforehand
(PEFT methods are usually trained at higher rates than full fine-tuning). Writes
experiments/results/peft_compare.{md,json,png} (--out): trainable parameters, their fraction of
the model, optimiser memory, final validation loss and step time, and the loss curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tfx.train.config import DataConfig, OptimConfig, PeftConfig, TrainConfig
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer, train
from tfx.train.metrics import read_metrics

# method -> (PeftConfig settings, learning rate)
METHODS = {
    "full": (dict(method="full"), 3e-4),
    "lora": (dict(method="lora", rank=8, alpha=16.0, targets=("query", "value")), 2e-3),
    "lora_seed_init": (dict(method="lora", rank=8, alpha=16.0, targets=("query", "value"),
                            init_style="seed"), 2e-3),
    "prompt": (dict(method="prompt", num_tokens=16, prompt_init="vocab"), 3e-2),
    "prefix": (dict(method="prefix", num_tokens=16), 1e-2),
    "adapter": (dict(method="adapter", adapter_size=16, adapter_placement="houlsby"), 2e-3),
}
RESULTS = Path(__file__).parent / "results"


def fine_tune_corpus() -> str:
    return str(Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py")


def base_experiment(smoke: bool):
    e = get_experiment("gpt_char")
    if not smoke:
        return e
    model = e.model.replace(d_model=32, num_heads=2, num_kv_heads=None, d_ff=64, num_layers=1)
    return dataclasses.replace(e, model=model, train=TrainConfig(
        steps=3, batch_size=4, seq_len=32, eval_every=3, eval_batches=1, checkpoint_every=3))


def fine_tune_experiment(base, base_dir: Path, method: str, steps: int, smoke: bool):
    settings, learning_rate = METHODS.get(method, (dict(method="full"), 3e-4))
    train_config = dataclasses.replace(
        base.train, steps=steps, init_from=str(base_dir), log_every=1 if smoke else 10,
        eval_every=steps if smoke else 50, checkpoint_every=steps)
    return dataclasses.replace(
        base, name=f"peft_{method}", train=train_config, peft=PeftConfig(**settings),
        data=DataConfig(source=fine_tune_corpus()),
        optim=OptimConfig(learning_rate=learning_rate, warmup_steps=min(20, steps)))


def measure(experiment, workdir: Path, *, frozen: bool) -> dict:
    """Train (unless frozen) and collect the table's numbers and the validation curve."""
    trainer = Trainer(experiment, workdir)
    state = trainer.state
    trainable = 0 if frozen else sum(x.size for x in jax.tree.leaves(state.params))
    total = sum(x.size for x in jax.tree.leaves((state.params, state.frozen)))
    optimizer_bytes = 0 if frozen else sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    if frozen:
        validation = trainer.evaluate()
        trainer.close()
        return {"trainable_params": 0, "trainable_fraction": 0.0, "optimizer_bytes": 0,
                "val_loss": validation["loss"], "val_accuracy": validation["accuracy"],
                "step_seconds": None, "curve": []}
    trainer.close()
    result = train(experiment, workdir, progress=False)
    records = read_metrics(workdir / "metrics.jsonl")
    speeds = [r["tokens_per_s"] for r in records if r.get("split") == "train"
              and "tokens_per_s" in r][1:]  # the first includes compilation
    tokens = experiment.train.batch_size * experiment.train.seq_len
    curve = [(r["step"], r["loss"]) for r in records if r.get("split") == "val"]
    return {"trainable_params": int(trainable), "trainable_fraction": trainable / total,
            "optimizer_bytes": int(optimizer_bytes), "val_loss": result.validation["loss"],
            "val_accuracy": result.validation["accuracy"],
            "step_seconds": tokens / statistics.median(speeds) if speeds else None,
            "curve": curve}


def table(results: dict, command: str, revision: str) -> str:
    lines = [f"Command: `{command}` at revision `{revision}`.", "",
             "| method | trainable params | fraction | optimiser memory | val loss | "
             "val accuracy | s/step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method, r in results.items():
        seconds = "-" if r["step_seconds"] is None else f"{r['step_seconds']:.3f}"
        lines.append(f"| {method} | {r['trainable_params']:,} | {r['trainable_fraction']:.3%} | "
                     f"{r['optimizer_bytes'] / 2**20:.2f} MiB | {r['val_loss']:.4f} | "
                     f"{r['val_accuracy']:.3f} | {seconds} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, r in results.items():
        if r["curve"]:
            steps, losses = zip(*r["curve"], strict=True)
            ax.plot(steps, losses, marker="o", label=method)
        else:
            ax.axhline(r["val_loss"], color="gray", linestyle="--", label=method)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Fine-tuning char GPT on pydoc topics")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--base", type=Path, help="a trained gpt_char workdir to start from")
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per method")
    parser.add_argument("--workdir", type=Path, help="where runs go (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for md/json/png")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    args = parser.parse_args(argv)
    steps = 2 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        base = base_experiment(args.smoke)
        base_dir = args.base
        if base_dir is None:
            base_dir = workdir / "base"
            train(base, base_dir, progress=not args.smoke)
        results = {"frozen": measure(fine_tune_experiment(base, base_dir, "frozen", steps,
                                                          args.smoke), workdir / "frozen",
                                     frozen=True)}
        for method in METHODS:
            experiment = fine_tune_experiment(base, base_dir, method, steps, args.smoke)
            results[method] = measure(experiment, workdir / method, frozen=False)
            print(f"{method}: val loss {results[method]['val_loss']:.4f}", flush=True)
    command = "python experiments/peft_compare.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    revision = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results, command, revision)
    (args.out / "peft_compare.md").write_text(text)
    payload = json.dumps({"command": command, "revision": revision, "results": results},
                         indent=2)
    (args.out / "peft_compare.json").write_text(payload)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.out / "peft_compare.png")
    print(text)
    return results


if __name__ == "__main__":
    main()
