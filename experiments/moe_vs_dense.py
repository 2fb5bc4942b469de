"""A dense decoder against mixture-of-experts decoders with the same active parameters per token.

    python experiments/moe_vs_dense.py [--steps 200] [--json PATH] [--workdir DIR] [--smoke]

Trains three models for the same steps on the same batches with the same seed (the gpt_char
recipe): `dense`, the char-gpt preset (SwiGLU MLP of width 1024); `moe_k1`, 8 SwiGLU experts of
width 1024 in every layer, top-1 (Switch routing); `moe_k2`, 8 experts of width 512, top-2 (the
moe_gpt experiment). All train dropless (no capacity limit), with moe_gpt's load-balancing and
router z losses. Measured: validation loss and training tokens/s; each MoE layer's expert load
(share of the routed assignments per expert) on the validation batches; and the fraction of
token-assignments the trained routers would drop at capacity factors 1.0, 1.25 and 2.0, found
by routing the real hidden states that enter each MoE layer with that capacity, together with
the validation loss of each MoE model run at those capacities. Writes
experiments/results/moe_vs_dense.{md,json,png} (--out).

Paper claim checked (Fedus et al. 2021, Switch Transformer): at equal compute per token a
sparse MoE model reaches a lower loss than the dense one, and a larger capacity factor drops
fewer tokens. On CPU the experts' dispatch (sorting tokens by expert) costs more time than its
FLOPs suggest, so the MoE models' tokens/s is lower than the dense one's at equal FLOPs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.models import create
from tfx.nn.moe import MoE
from tfx.ops import moe
from tfx.train.config import Experiment
from tfx.train.experiments import get_experiment
from tfx.train.loop import Trainer
from tfx.train.objectives import causal_lm
from tfx.train.step import finish_eval

CAPACITY_FACTORS = (1.0, 1.25, 2.0)
MOE_MODELS = ("moe_k1", "moe_k2")


def experiments(steps: int, smoke: bool) -> dict[str, Experiment]:
    """name -> Experiment: dense, moe_k1 and moe_k2, alike but for the feed-forward layers."""
    dense, moe_k2 = get_experiment("gpt_char"), get_experiment("moe_gpt")
    moe_k1 = dataclasses.replace(
        moe_k2, model=moe_k2.model.replace(moe={"experts_per_token": 1, "d_ff": dense.model.d_ff}))
    runs = {"dense": dense, "moe_k1": moe_k1, "moe_k2": moe_k2}
    return {name: _sized(e, name, steps, smoke) for name, e in runs.items()}


def _sized(experiment: Experiment, name: str, steps: int, smoke: bool) -> Experiment:
    """`experiment` renamed, run for `steps` (a tiny model and a few steps when smoke)."""
    t = experiment.train
    if smoke:
        # Widths keep the full run's proportions: k experts of width d_ff / k.
        m = experiment.model
        model = m.replace(d_model=32, num_heads=2, attention={"num_kv_heads": 1}, num_layers=1,
                          d_ff=64, moe=None if m.moe is None else {
                              "d_ff": 64 // m.moe.experts_per_token})
        return dataclasses.replace(experiment, name=name, model=model,
                                   train=harness.smoke_train(t, steps=steps))
    eval_every = max(1, steps // 5)
    train = dataclasses.replace(t, steps=steps, eval_every=eval_every, checkpoint_every=steps)
    return dataclasses.replace(experiment, name=name, train=train)


def parameter_counts(model: nnx.Module) -> tuple[int, int]:
    """(parameters, active parameters per token): every routed expert beyond the k a token
    uses is inactive."""
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    inactive = 0
    for layer in _moe_layers(model):
        experts, k = layer.experts.up.shape[0], dict(layer.options)["num_selected"]
        expert_sizes = sum(x.size for x in jax.tree.leaves(nnx.state(layer.experts, nnx.Param)))
        inactive += expert_sizes * (experts - k) // experts
    return int(total), int(total - inactive)


def _moe_layers(model: nnx.Module) -> list[MoE]:
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]


class InputRecorder(nnx.Module):
    """Stands in for a block's MoE: calls it unchanged and keeps its input [batch, seq, d_model]
    in `hidden`, so that the trained router can be rerun on the real hidden states."""

    def __init__(self, layer: MoE):
        self.layer = layer
        self.hidden = nnx.Intermediate(jnp.zeros((), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.hidden.set_value(x)
        return self.layer(x)


def record_moe_inputs(model: nnx.Module) -> None:
    """Put an InputRecorder around the MoE of every block of `model` (in place). A causal LM
    has no padding, so the MoE loses nothing by not getting a token mask."""
    blocks = [m for _, m in nnx.iter_graph(model) if isinstance(getattr(m, "mlp", None), MoE)]
    for block in blocks:
        block.mlp = InputRecorder(block.mlp)


@nnx.jit
def _route_batch(model: nnx.Module, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Run `model` (with recorders) on one validation batch and reroute each MoE layer's input.

    Returns:
      load: float32 [layers, experts], each expert's share of the dropless assignments;
      dropped: float32 [layers, len(CAPACITY_FACTORS)], the share of token-assignments dropped
        at each capacity factor (capacity from the batch's tokens, as in training).
    """
    model(tokens[:, :-1])
    loads, dropped = [], []
    for recorder in [m for _, m in nnx.iter_graph(model) if isinstance(m, InputRecorder)]:
        options = dict(recorder.layer.options)
        hidden = recorder.hidden[...]
        logits = moe.router_logits(hidden.reshape(-1, hidden.shape[-1]),
                                   recorder.layer.router.kernel[...])

        def routed(capacity_factor, logits=logits, options=options):
            return moe.route(logits, num_selected=options["num_selected"],
                             policy=options["policy"], capacity_factor=capacity_factor)

        loads.append(moe.expert_load(routed(None), logits.shape[-1]))
        dropped.append(jnp.stack([1.0 - routed(cf).kept.mean() for cf in CAPACITY_FACTORS]))
    return jnp.stack(loads), jnp.stack(dropped)


def routing_statistics(model: nnx.Module, batches: list[dict]) -> dict:
    """Expert load and dropped fractions of `model`'s trained routers over `batches`, each
    the mean over batches (all of one size, so the mean of shares is the pooled share)."""
    model = nnx.clone(model)  # the recorders go into a copy
    record_moe_inputs(model)
    per_batch = [_route_batch(model, jnp.asarray(batch["tokens"])) for batch in batches]
    load = np.mean([np.asarray(b[0]) for b in per_batch], axis=0)
    dropped = np.mean([np.asarray(b[1]) for b in per_batch], axis=(0, 1))
    return {"expert_load": load.tolist(),
            "dropped_fraction": {str(cf): float(d)
                                 for cf, d in zip(CAPACITY_FACTORS, dropped, strict=True)}}


def with_capacity(model: nnx.Module, capacity_factor: float) -> nnx.Module:
    """A copy of `model` (same weights, eval mode) whose MoE layers have that capacity."""
    copy = create(model.config.replace(moe={"capacity_factor": capacity_factor}),
                  rngs=nnx.Rngs(0))
    nnx.update(copy, nnx.state(model, nnx.Param))
    copy.eval()
    return copy


@nnx.jit
def _loss_sums(model: nnx.Module, batch: dict):
    """(loss sum, target count, metric sums) of one batch, as tfx.train's eval step."""
    return causal_lm(model, batch, None)


def validation_loss(model: nnx.Module, batches: list[dict]) -> float:
    """Mean next-token loss (nats/byte) of `model` over `batches`."""
    return finish_eval([_loss_sums(model, jax.device_put(b)) for b in batches])["loss"]


def measure(experiment: Experiment, run: Path) -> dict:
    """Train `experiment` in `run`, then count its parameters and, for an MoE model, study its
    trained routers on the validation batches."""
    result = harness.train_measured(experiment, run)
    trainer = Trainer(experiment, run)
    trainer.restore()
    model, batches = trainer.model(), trainer.feed.validation()
    trainer.close()
    result["params"], result["active_params"] = parameter_counts(model)
    if experiment.model.moe is not None:
        result["val_loss_at_capacity"] = {
            str(cf): validation_loss(with_capacity(model, cf), batches)
            for cf in CAPACITY_FACTORS}
        tokens = batches[0]["tokens"].shape[0] * (batches[0]["tokens"].shape[1] - 1)
        result["capacity"] = {
            str(cf): moe.expert_capacity(tokens, experiment.model.moe.num_experts,
                                         experiment.model.moe.experts_per_token, cf)
            for cf in CAPACITY_FACTORS}
        result.update(routing_statistics(model, batches))
    return result


def table(results: dict) -> str:
    """The comparison table, then each MoE layer's expert load."""
    no_router = "n/a: dense, no router"
    rows = []
    for name in ("dense", *MOE_MODELS):
        r = results[name]
        row = [name, f"{r['params']:,}", f"{r['active_params']:,}", f"{r['val_loss']:.4f}",
               f"{r['tokens_per_s']:.0f}"]
        for cf in map(str, CAPACITY_FACTORS):
            row += ([no_router] * 2 if name == "dense" else
                    [f"{r['val_loss_at_capacity'][cf]:.4f}",
                     f"{results['dropped_fraction'][cf][name]:.2%} (C={r['capacity'][cf]})"])
        rows.append(row)
    header = ["model", "params", "active params / token", "val loss (dropless)",
              "train tokens/s"]
    for cf in CAPACITY_FACTORS:
        header += [f"val loss at cf {cf}", f"dropped at cf {cf}"]
    comparison = harness.markdown_table(header, rows) + (
        "\nAll three trained dropless. Dropped: the share of token-assignments (tokens x k) "
        "over capacity when the trained routers route the hidden states that enter each MoE "
        "layer on the validation batches, C assignments per expert and batch; val loss at cf: "
        "the same weights run with that capacity. Tokens/s: training, on this machine's "
        "CPUs, where the experts' sorted dispatch costs more than its FLOPs.\n")
    experts = len(results["moe_k1"]["expert_load"][0])
    load_rows = [[name, layer, *(f"{share:.3f}" for share in shares)]
                 for name in MOE_MODELS
                 for layer, shares in enumerate(results[name]["expert_load"])]
    load = harness.markdown_table(["model", "layer", *(f"expert {i}" for i in range(experts))],
                                  load_rows)
    return (comparison + "\nExpert load: share of the routed (dropless) assignments per expert "
            "on the validation batches (balanced = "
            f"{1 / experts:.3f}).\n\n" + load)


def plot(results: dict, path: Path) -> None:
    """Validation curves, the expert load of each MoE model, dropped share vs capacity."""
    fig, axes = harness.plt.subplots(2, 2, figsize=(11, 8))
    curves, drops = axes[0]
    for name in ("dense", *MOE_MODELS):
        steps, losses = zip(*results[name]["curve"], strict=True)
        curves.plot(steps, losses, marker="o", label=name)
    curves.set(xlabel="step", ylabel="validation loss (nats/byte)", title="Validation loss")
    curves.legend()
    for name in MOE_MODELS:
        drops.plot(CAPACITY_FACTORS, [results["dropped_fraction"][str(cf)][name]
                                      for cf in CAPACITY_FACTORS], marker="o", label=name)
    drops.set(xlabel="capacity factor", ylabel="dropped token-assignments",
              title="Drops of the trained routers", xticks=CAPACITY_FACTORS)
    drops.legend()
    for ax, name in zip(axes[1], MOE_MODELS, strict=True):
        load = np.asarray(results[name]["expert_load"])
        width = 0.8 / len(load)
        for layer, shares in enumerate(load):
            ax.bar(np.arange(load.shape[1]) + (layer - (len(load) - 1) / 2) * width, shares, width,
                   label=f"layer {layer}")
        ax.axhline(1 / load.shape[1], color="gray", linestyle="--", label="balanced")
        ax.set(xlabel="expert", ylabel="share of assignments", title=f"Expert load, {name}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, default=200, help="training steps per model")
    args = parser.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    results = {}
    with harness.workdir(args) as runs:
        for name, experiment in experiments(steps, args.smoke).items():
            results[name] = measure(experiment, runs / name)
            print(f"{name}: val loss {results[name]['val_loss']:.4f}", flush=True)
    dropped = {name: results[name].pop("dropped_fraction") for name in MOE_MODELS}
    results["dropped_fraction"] = {cf: {name: dropped[name][cf] for name in MOE_MODELS}
                                   for cf in map(str, CAPACITY_FACTORS)}
    harness.publish("moe_vs_dense", results, table=table(results),
                    plot=lambda path: plot(results, path), args=args, argv=argv)
    return results


if __name__ == "__main__":
    main()
