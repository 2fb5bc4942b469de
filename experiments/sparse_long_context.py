"""Dense vs sparse causal attention at long context: validation loss and training step time.

    python experiments/sparse_long_context.py [--steps 120] [--context 2048] [--json PATH]
        [--workdir DIR] [--out DIR] [--smoke]

Trains the same small byte-level decoder (gpt_char's LLaMA-style model at d_model 128, 2 layers)
on the embedded corpus at context --context, once per attention pattern, with the same seed,
batches, steps and schedule: dense causal attention; a sliding window; the strided pattern of
Child et al. 2019; and a BigBird-style union of a window, global tokens and random blocks. Each
pattern is a `DecoderConfig.attention_pattern` (intersected with causal attention), sized as a
fraction of the context so that every sparse pattern keeps about 12-13% of the causal (query,
key) pairs at any --context. Writes experiments/results/sparse_long_context.{md,json,png}
(--out): the final validation loss, the median training step time, the fraction of causal pairs
attended (from the spec's dense mask), the attention kernel that runs and, for the blocked
kernel, the fraction of the causal tiles it computes (it skips tiles the mask leaves empty);
the plot shows the validation-loss curves and the step times.

Claim checked (Child et al. 2019, "Generating Long Sequences with Sparse Transformers"): sparse
attention patterns match dense attention's quality at a fraction of its cost.
"""

from __future__ import annotations

import dataclasses

import harness
import jax
import numpy as np

from tfx.models.config import compute_dtype
from tfx.ops.attention.tile_sizes import visited_pairs
from tfx.ops.backends import AttentionCase, select_attention
from tfx.ops.sparse import Causal, parse_spec
from tfx.train.config import TrainConfig
from tfx.train.experiments import get_experiment

NAME = "sparse_long_context"


def patterns(context: int) -> dict[str, str | None]:
    """Pattern name -> `attention_pattern` text (None: dense causal), sized from the context:
    at 2048, window 128, stride 128 and BigBird's window 64, 16 global tokens and 2 random
    blocks of 64 per query block, each about 12-13% of the causal pairs."""
    unit = max(1, context // 16)
    return {
        "dense": None,
        "sliding_window": f"window:{unit}",
        "strided": f"strided:{unit}",
        "bigbird": (f"window:{max(1, unit // 2)}|global:{max(1, unit // 8)}"
                    f"|random:{max(1, unit // 2)},2"),
    }


def experiment(context: int, steps: int, smoke: bool):
    """gpt_char's model and optimiser, made small enough to train at `context` on 2 CPU cores
    (2 sequences a step), warming up for the first sixth of the steps."""
    e = get_experiment("gpt_char")
    model = e.model.replace(d_model=128, num_heads=4, attention={"num_kv_heads": 2}, d_ff=512,
                            num_layers=2, max_len=context)
    train = TrainConfig(steps=steps, batch_size=2, seq_len=context, log_every=10,
                        eval_every=max(1, steps // 5), eval_batches=8, checkpoint_every=steps)
    if smoke:
        model = model.replace(d_model=32, num_heads=2, attention={"num_kv_heads": None}, d_ff=64,
                              num_layers=1)
        train = harness.smoke_train(train, steps=steps, seq_len=context)
    optim = dataclasses.replace(e.optim, warmup_steps=steps // 6)
    return dataclasses.replace(e, name=NAME, model=model, train=train, optim=optim)


def mask_facts(model, spec_text: str | None, context: int) -> dict:
    """How much of causal attention a pattern keeps: attended_fraction, the attended share of
    the causal (query, key) pairs; kernel, the attention kernel that runs on this platform;
    tile_fraction, for the blocked kernel, the pairs it computes (its visited tiles, on the
    pieces and tiles it chooses: `tfx.ops.attention.tile_sizes.visited_pairs`) as a share of causal
    attention's."""
    causal = Causal()
    spec = causal if spec_text is None else causal & parse_spec(spec_text)
    attended = spec.dense(context, context).sum() / causal.dense(context, context).sum()
    head_dim = model.attention.head_dim or model.d_model // model.num_heads
    platform = jax.default_backend()
    kernel = select_attention(platform, AttentionCase(
        dtype=np.dtype(compute_dtype(model.compute.dtype, platform) or np.float32), q_len=context,
        kv_len=context, num_heads=model.num_heads, num_kv_heads=model.kv_heads,
        head_dim=head_dim, value_dim=head_dim, spec=spec))
    tiles = None
    if kernel == "blocked":
        tiles = visited_pairs(spec, context, context) / visited_pairs(causal, context, context)
    return {"attended_fraction": float(attended), "kernel": kernel, "tile_fraction": tiles}


def run(args) -> dict:
    """Train one model per pattern; {pattern: measurements}."""
    base = experiment(args.context, args.steps, args.smoke)
    results = {}
    with harness.workdir(args) as runs:
        for name, spec in patterns(args.context).items():
            e = dataclasses.replace(base, model=base.model.replace(attention={"pattern": spec}))
            measured = harness.train_measured(e, runs / name)
            results[name] = {"spec": spec, "val_loss": measured["val_loss"],
                             "step_seconds": measured["step_seconds"],
                             **mask_facts(e.model, spec, args.context),
                             "curve": measured["curve"]}
    return results


def _cell(value, digits: int, missing: str) -> str:
    return missing if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    """Every number of `results` (but the curves), with the reason where a cell is empty."""
    dense_time = results["dense"]["step_seconds"]
    rows = []
    for name, r in results.items():
        ratio = (None if r["step_seconds"] is None or dense_time is None
                 else r["step_seconds"] / dense_time)
        spec = (r["spec"] or "causal").replace("|", "\\|")  # a bare | would split the cell
        rows.append([name, f"`{spec}`", f"{r['attended_fraction']:.1%}",
                     f"{r['val_loss']:.4f}",
                     _cell(r["step_seconds"], 3, "n/a: too few steps logged"),
                     _cell(ratio, 2, "n/a: too few steps logged"), r["kernel"],
                     "n/a: the reference kernel computes every score" if r["tile_fraction"]
                     is None else f"{r['tile_fraction']:.0%}"])
    return harness.markdown_table(
        ["pattern", "spec (& causal)", "causal pairs attended", "val loss (nats/byte)",
         "step seconds (median)", "step time / dense", "kernel", "causal tiles computed"], rows)


def plot(results: dict):
    """Validation-loss curves (left) and step-time bars (right)."""
    def draw(path):
        fig, (curves, bars) = harness.plt.subplots(1, 2, figsize=(11, 4))
        for name, r in results.items():
            steps, losses = zip(*r["curve"], strict=True)
            curves.plot(steps, losses, marker="o", label=name)
        curves.set(xlabel="step", ylabel="validation loss (nats/byte)",
                   title="validation loss")
        curves.legend()
        names = list(results)
        bars.bar(names, [results[n]["step_seconds"] or 0.0 for n in names])
        bars.set(ylabel="seconds per training step (median)", title="training step time")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    return draw


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per pattern (default 120; smoke 3)")
    parser.add_argument("--context", type=int, default=None,
                        help="sequence length (default 2048; smoke 64)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.smoke else 120)
    args.context = args.context or (64 if args.smoke else 2048)
    results = run(args)
    harness.publish(NAME, results, table=table(results), plot=plot(results), args=args,
                    argv=argv)
    return results


if __name__ == "__main__":
    main()
