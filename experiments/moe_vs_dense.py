"""Dense decoders against mixture-of-experts decoders at equal active and at equal total
parameters, trained long enough that every expert gets a fair share of the tokens.

    python experiments/moe_vs_dense.py [--steps 1000] [--json PATH] [--workdir DIR] [--smoke]

Trains four models for the same steps on the same batches with the same seed (the gpt_char
recipe, scaled down in size so that the steps the experts need fit the time budget: d_model
128, 2 layers, 4 heads): `dense`, a SwiGLU MLP of width 512; `moe_k1`, 4 SwiGLU experts of
width 512 in every layer, top-1 (Switch routing); `moe_k2`, 8 experts of width 256, top-2;
`dense_wide`, a SwiGLU MLP of width 2048. So `dense`, `moe_k1` and `moe_k2` have the same
active parameters per token (the routers aside), and `dense_wide`, `moe_k1` and `moe_k2` the
same total. Each expert receives k/E = 1/4 of the token-assignments; the default 1000 steps of
16 x 128 tokens give each 512,000, more than the whole MLP of the earlier 200-step comparison
at gpt_char's size saw (409,600), where each of 8 top-1 experts got 51,200. The table states
the tokens per expert. All train dropless
(no capacity limit), with moe_gpt's load-balancing and router z losses. Measured: validation
loss and training tokens/s; each MoE layer's expert load (share of the routed assignments per
expert) on the validation batches; and the fraction of token-assignments the trained routers
would drop at capacity factors 1.0, 1.25 and 2.0, found
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
MODELS = ("dense", "dense_wide", *MOE_MODELS)
D_MODEL, D_FF, LAYERS = 128, 512, 2  # D_FF: the active MLP width; smoke: 32, 64 and 1 layer
# name -> (experts, experts per token); dense models: (None, width in units of D_FF).
SHAPES = {"dense": (None, 1), "dense_wide": (None, 4), "moe_k1": (4, 1), "moe_k2": (8, 2)}


def experiments(steps: int, smoke: bool) -> dict[str, Experiment]:
    """name -> Experiment for each of MODELS, alike but for the feed-forward layers: an active
    width of D_FF per token in all but dense_wide, a total of 8 D_FF in all but dense."""
    moe_gpt = get_experiment("moe_gpt")
    d_model, d_ff = (32, 64) if smoke else (D_MODEL, D_FF)
    base = moe_gpt.model.replace(d_model=d_model, num_layers=1 if smoke else LAYERS,
                                 num_heads=2 if smoke else 4)
    runs = {}
    for name, (experts, k) in SHAPES.items():
        model = (base.replace(d_ff=d_ff * k, moe=None) if experts is None else
                 base.replace(d_ff=d_ff, moe={"num_experts": experts, "experts_per_token": k,
                                              "d_ff": d_ff // k}))
        runs[name] = _sized(dataclasses.replace(moe_gpt, name=name, model=model), steps, smoke)
    return runs


def _sized(experiment: Experiment, steps: int, smoke: bool) -> Experiment:
    """`experiment` run for `steps` (a few short sequences when smoke)."""
    if smoke:
        return dataclasses.replace(experiment, train=harness.smoke_train(experiment.train,
                                                                         steps=steps))
    train = dataclasses.replace(experiment.train, steps=steps, eval_every=max(1, steps // 6),
                                checkpoint_every=steps)
    return dataclasses.replace(experiment, train=train)


def tokens_per_expert(experiment: Experiment) -> int:
    """Token-assignments each expert (or the dense MLP) receives over the run, on average:
    steps x tokens per step x k / E."""
    t, moe_config = experiment.train, experiment.model.moe
    tokens = t.steps * t.batch_size * t.seq_len
    if moe_config is None:
        return tokens
    return tokens * moe_config.experts_per_token // moe_config.num_experts


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
    result["tokens_per_expert"] = tokens_per_expert(experiment)
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
    for name in MODELS:
        r = results[name]
        row = [name, f"{r['params']:,}", f"{r['active_params']:,}",
               f"{r['tokens_per_expert']:,}", f"{r['val_loss']:.4f}", f"{r['tokens_per_s']:.0f}"]
        for cf in map(str, CAPACITY_FACTORS):
            row += ([no_router] * 2 if name not in MOE_MODELS else
                    [f"{r['val_loss_at_capacity'][cf]:.4f}",
                     f"{results['dropped_fraction'][cf][name]:.2%} (C={r['capacity'][cf]})"])
        rows.append(row)
    header = ["model", "params", "active params / token", "tokens per expert (dense: MLP)",
              "val loss (dropless)", "train tokens/s"]
    for cf in CAPACITY_FACTORS:
        header += [f"val loss at cf {cf}", f"dropped at cf {cf}"]
    comparison = harness.markdown_table(header, rows) + (
        "\nAll four trained dropless; tokens per expert: the token-assignments each expert "
        "received over training on average (steps x tokens per step x k / E). Dropped: the "
        "share of token-assignments (tokens x k) over capacity when the trained routers route "
        "the hidden states that enter each MoE layer on the validation batches, C assignments "
        "per expert and batch; val loss at cf: the same weights run with that capacity. "
        "Tokens/s: training, on this machine's CPUs, where the experts' sorted dispatch costs "
        "more than its FLOPs.\n")
    loads = []
    for name in MOE_MODELS:
        experts = len(results[name]["expert_load"][0])
        rows = [[layer, *(f"{share:.3f}" for share in shares)]
                for layer, shares in enumerate(results[name]["expert_load"])]
        loads.append(f"\nExpert load of {name}: share of the routed (dropless) assignments per "
                     f"expert on the validation batches (balanced = {1 / experts:.4f}).\n\n"
                     + harness.markdown_table(["layer", *map(str, range(experts))], rows))
    return comparison + "".join(loads)


def plot(results: dict, path: Path) -> None:
    """Validation curves, the expert load of each MoE model, dropped share vs capacity."""
    fig, axes = harness.plt.subplots(2, 2, figsize=(11, 8))
    curves, drops = axes[0]
    for name in MODELS:
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
    parser.add_argument("--steps", type=int, default=1000, help="training steps per model")
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
