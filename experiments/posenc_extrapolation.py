"""Positional encodings beyond the training length: the same small decoder trained at context
128 with each encoding, then evaluated at contexts 128, 256, 512 and 1024.

    python experiments/posenc_extrapolation.py [--steps 300] [--json PATH] [--workdir DIR] \
        [--out DIR] [--smoke]

Each encoding of tfx.models.config.POSITIONS (learned, sinusoidal, rope, alibi, t5, xl, none)
trains the same byte-level decoder (the `posenc_<kind>` experiments, made smaller to fit a CPU)
with the same seed, batches, schedule and steps on the embedded corpus at context 128. Then
each model reads the same held-out text (spans of 1024 tokens from the validation split)
cut into windows of 128, 256, 512 and 1024 tokens, so every context length predicts exactly
the same tokens and only the context a token sees differs. The loss is the mean cross-entropy
over every token of every window (nats/byte). The learned table has exactly the training
context's 128 positions, so it cannot read longer windows (null in the JSON, the reason in the
table). Transformer-XL ("xl") reads each whole window with no memory of earlier segments.
Writes experiments/results/posenc_extrapolation.{md,json,png} (--out); --json PATH gets
{encoding: {"128": loss, "256": loss, "512": loss, "1024": loss}}.

Published findings this checks:
- Press et al. 2022 (ALiBi, "Train Short, Test Long"): ALiBi's loss stays stable (even
  improves) beyond the training length; sinusoidal positions degrade sharply; rotary
  embeddings degrade, more moderately; T5's relative bias extrapolates somewhat, at a cost.
- Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length Generalization in
  Transformers"): a decoder-only model without positional encoding (NoPE) learns positions
  from the causal mask and generalises beyond its training length better than most encodings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import harness
import jax
import numpy as np

from tfx.models.config import POSITIONS, DecoderConfig
from tfx.train.config import Experiment, OptimConfig, TrainConfig
from tfx.train.data import TokenStream
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer
from tfx.train.step import finish_eval

NAME = "posenc_extrapolation"
TRAIN_LEN = 128
EVAL_LENS = (128, 256, 512, 1024)
# A smaller char-gpt (the posenc_<kind> experiments' model), so that seven trainings fit.
MODEL = dict(d_model=128, num_layers=3, num_heads=4, attention={"num_kv_heads": 2}, d_ff=384)
SMOKE_MODEL = dict(d_model=32, num_layers=1, num_heads=2, attention={"num_kv_heads": 1},
                   d_ff=64)
BATCH_SIZE = 16
# Held-out spans of max(EVAL_LENS) tokens: 16 x 1024 = 16384 tokens scored at every length.
NUM_SPANS, SMOKE_SPANS = 16, 2
LEARNED_REASON = f"beyond the learned table of {TRAIN_LEN} positions"


def experiment(kind: str, *, steps: int, smoke: bool) -> Experiment:
    """The `posenc_<kind>` experiment at this script's size: learned positions get a table of
    exactly TRAIN_LEN entries, the others are configured for the longest evaluation."""
    base = get_experiment(f"posenc_{kind}")
    max_len = TRAIN_LEN if kind == "learned" else EVAL_LENS[-1]
    model = base.model.replace(max_len=max_len, **(SMOKE_MODEL if smoke else MODEL))
    train = TrainConfig(steps=steps, batch_size=BATCH_SIZE, seq_len=TRAIN_LEN, log_every=25,
                        eval_every=steps, eval_batches=4, checkpoint_every=steps)
    if smoke:
        train = harness.smoke_train(train, steps=steps, seq_len=TRAIN_LEN)
    optim = OptimConfig(learning_rate=base.optim.learning_rate,
                        warmup_steps=min(base.optim.warmup_steps, steps // 10))
    return dataclasses.replace(base, model=model, train=train, optim=optim)


def held_out_spans(stream: TokenStream, num_spans: int) -> np.ndarray:
    """int32 [num_spans, max(EVAL_LENS) + 1]: evenly spaced spans of the validation stream."""
    return stream.eval_batches(1, num_spans, EVAL_LENS[-1])[0]


def windows(spans: np.ndarray, length: int) -> np.ndarray:
    """Cut each span [S, L_max + 1] into L_max / length consecutive windows of `length` inputs
    and their next-token targets: int32 [S * L_max / length, length + 1]. Consecutive windows
    share one token (the last target of one is the first input of the next), so the windows of
    every length score the same L_max targets of each span."""
    per_span = (spans.shape[1] - 1) // length
    index = np.arange(per_span)[:, None] * length + np.arange(length + 1)
    return spans[:, index].reshape(-1, length + 1)


def beyond_table(model: DecoderConfig, length: int) -> bool:
    """Whether `model` cannot read `length` tokens: learned positions past their table."""
    return model.position == "learned" and length > model.max_len


def context_losses(experiment: Experiment, workdir: Path, num_spans: int) -> dict:
    """The trained run in `workdir` evaluated at every length of EVAL_LENS on the same held-out
    spans: {str(length): mean loss per token, or None where the model cannot run}. One batch
    per length, so the eval step compiles once per length."""
    trainer = Trainer(experiment, workdir)
    try:
        trainer.restore()
        spans = held_out_spans(trainer.feed.val_stream, num_spans)
        rng = jax.random.key(experiment.train.seed)
        losses = {}
        for length in EVAL_LENS:
            if beyond_table(experiment.model, length):
                losses[str(length)] = None
                continue
            batch = jax.device_put({"tokens": windows(spans, length)})
            losses[str(length)] = finish_eval([trainer.eval_step(trainer.state, batch, rng)])[
                "loss"]
        return losses
    finally:
        trainer.close()


def table(results: dict, experiments: dict[str, Experiment], num_spans: int) -> str:
    """The markdown table: one row per encoding, one column per evaluation context."""
    header = ["encoding", *(f"{n} (trained)" if n == TRAIN_LEN else str(n) for n in EVAL_LENS)]
    rows = [[kind, *(LEARNED_REASON if loss is None else f"{loss:.4f}" for loss in
                     losses.values())] for kind, losses in results.items()]
    e = next(iter(experiments.values()))
    m, t = e.model, e.train
    notes = (f"Validation loss (nats/byte, mean over every token of each window) of a "
             f"{m.num_layers}-layer decoder (d_model {m.d_model}, {m.num_heads} heads, "
             f"{m.kv_heads} KV heads, SwiGLU {m.d_ff}) trained for {t.steps} steps of "
             f"{t.batch_size} x {t.seq_len} bytes with each positional encoding. Every column "
             f"scores the same {num_spans * EVAL_LENS[-1]} held-out tokens ({num_spans} spans "
             f"of {EVAL_LENS[-1]}, cut into windows of the column's length). Transformer-XL "
             f"(xl) reads each whole window with no memory of earlier segments.\n\n")
    return notes + harness.markdown_table(header, rows)


def plot(results: dict, path: Path) -> None:
    """Loss against evaluation context (log2 axis), one line per encoding."""
    fig, ax = harness.plt.subplots(figsize=(7, 4.5))
    for kind, losses in results.items():
        points = [(int(n), loss) for n, loss in losses.items() if loss is not None]
        ax.plot(*zip(*points, strict=True), marker="o", label=kind)
    ax.axvline(TRAIN_LEN, color="gray", linestyle="--", label="training context")
    ax.set_xscale("log", base=2)
    ax.set_xticks(EVAL_LENS, [str(n) for n in EVAL_LENS])
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Positional encodings trained at context {TRAIN_LEN}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps per encoding")
    args = parser.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    num_spans = SMOKE_SPANS if args.smoke else NUM_SPANS
    experiments = {kind: experiment(kind, steps=steps, smoke=args.smoke) for kind in POSITIONS}
    results = {}
    with harness.workdir(args) as runs:
        for kind, e in experiments.items():
            trained = harness.train_measured(e, runs / kind)
            results[kind] = context_losses(e, runs / kind, num_spans)
            print(f"{kind}: validation loss {trained['val_loss']:.4f} after training, by "
                  f"context {results[kind]}", flush=True)
    harness.publish(NAME, results, table=table(results, experiments, num_spans),
                    plot=lambda path: plot(results, path), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
