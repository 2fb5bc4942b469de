"""The train state and the jitted train / eval steps, used functionally on `nnx.split` state.

One step = one optimiser update on the sum of `grad_accum` micro-batches (a `lax.scan`, so the
activations of only one micro-batch are alive at a time). Its random key is
fold_in(state.rng, state.step): a resumed run draws exactly what an uninterrupted run draws.

A step whose loss, gradient norm or updated parameters are not finite (NaN, inf) is not
applied: params and optimiser state stay as they were (so the state held is always the last
finite one), only `step` advances (that batch and key are used up), and `TrainState.nonfinite`
counts it. The counters live on the device and cost no synchronisation; the loop reads them
when it logs, evaluates or saves, and stops or goes on (train.nonfinite). The optimiser's own
step count (its learning-rate schedule) does not advance on a skipped step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tfx.nn.paths import path_name
from tfx.parallel import check_mesh_use
from tfx.train.config import Experiment, TrainConfig
from tfx.train.experts import MOE_METRICS, add_moe_losses, balance_experts, expert_loads
from tfx.train.optim import make_optimizer

__all__ = ["MOE_METRICS", "NonFinite", "TrainState", "finish_eval", "init_train_state",
           "initial_state", "make_eval_step", "make_train_step", "restore_template"]

_TRAIN = TrainConfig()  # the defaults of the MoE training settings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Counters (int32 []) of the steps skipped for a non-finite loss, gradient norm or update:
    `skipped` in all, `streak` of them in a row up to the latest step, the `longest` streak,
    and `first`, the number of the first one (its state.step + 1; 0 while there is none)."""

    skipped: jax.Array
    streak: jax.Array
    longest: jax.Array
    first: jax.Array

    @classmethod
    def zeros(cls) -> NonFinite:
        # Separate buffers: the train step donates its state, and one buffer can't be donated
        # twice.
        return cls(*(jnp.zeros((), jnp.int32) for _ in range(4)))

    def count(self, finite: jax.Array, step: jax.Array) -> NonFinite:
        """The counters after step number `step` (int32 []), finite or not (bool [])."""
        bad = jnp.logical_not(finite).astype(jnp.int32)
        streak = (self.streak + 1) * bad
        return NonFinite(skipped=self.skipped + bad, streak=streak,
                         longest=jnp.maximum(self.longest, streak),
                         first=jnp.where((self.first == 0) & (bad == 1), step, self.first))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """step: int32 []; params: the trained parameters (float32 master weights): all of the
    model's nnx.Param state, or only the PEFT parameters when fine-tuning with `tfx.peft`;
    frozen: the parameters not trained (empty unless fine-tuning with PEFT); opt_state: the
    optimiser's state, of `params` only; rng: uint32 key data [2] of the run's base key;
    nonfinite: the steps skipped for a non-finite loss (not checkpointed: they count the steps
    run since this state was made)."""

    step: jax.Array
    params: nnx.State
    frozen: nnx.State
    opt_state: optax.OptState
    rng: jax.Array
    nonfinite: NonFinite

    def to_dict(self) -> dict:
        """The checkpointed form. The frozen weights are left out: they are the run's
        starting point (train.init_from, or the seed's initialisation), rebuilt on resume."""
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
                "rng": self.rng}


def init_train_state(model: nnx.Module, optimizer: optax.GradientTransformation, *,
                     seed: int, trainable: nnx.filterlib.Filter = nnx.Param,
                     ) -> tuple[nnx.GraphDef, nnx.State, TrainState]:
    """Split `model` into (graphdef, non-parameter state, TrainState at step 0).

    trainable: which parameters the optimiser updates (`tfx.peft.PeftParam` to fine-tune only
    what a PEFT method added); the other nnx.Params go to `TrainState.frozen` and get neither
    gradients nor optimiser state. The state holds copies of the model's parameters: the train
    step donates its state, and the model itself stays usable.
    """
    graphdef, params, frozen, rest = nnx.split(model, trainable, nnx.Param, ...)
    params, frozen = jax.tree.map(jnp.copy, (params, frozen))
    rng = jax.random.key_data(jax.random.key(seed))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, frozen=frozen,
                       opt_state=optimizer.init(params), rng=rng, nonfinite=NonFinite.zeros())
    return graphdef, rest, state


def initial_state(experiment: Experiment, model: nnx.Module,
                  trainable: nnx.filterlib.Filter = nnx.Param) -> TrainState:
    """The TrainState at step 0 of a run of `experiment` that trains `model` (its optimiser
    and seed), as `init_train_state` makes it."""
    optimizer = make_optimizer(experiment.optim, experiment.train.steps)
    return init_train_state(model, optimizer, seed=experiment.train.seed,
                            trainable=trainable)[2]


def restore_template(state: TrainState | Callable[[], TrainState],
                     sharding: jax.sharding.Sharding | None = None) -> dict:
    """What `Checkpoints.restore` reads a step into: a `jax.ShapeDtypeStruct` per array of the
    checkpointed state (`TrainState.to_dict`).

    Args:
      state: the train state; or a function that makes it, then only traced (`jax.eval_shape`):
        no weights or optimiser moments are allocated.
      sharding: where every array is read to; None: where the array of `state` lies.
    """
    if callable(state):
        state = jax.eval_shape(state)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if sharding is None else sharding),
        state.to_dict())


def _merge(graphdef, params, frozen, rest, rng, *, train: bool):
    # Fresh Variables for the frozen weights and the non-parameter state (dropout's RNG
    # counters) in the current trace: NNX refuses to use a Variable of an outer trace (the
    # jitted step's) inside the gradient's trace, where nnx.scan over layers meets it.
    frozen, rest = jax.tree.map(lambda x: x, (frozen, rest))
    model = nnx.merge(graphdef, params, frozen, rest)
    if train:  # dropout and router noise draw from their own streams or the default one
        key = jax.random.fold_in(rng, 1)
        nnx.reseed(model, default=key, dropout=key, router=key)
    model.train() if train else model.eval()
    return model


def make_train_step(graphdef: nnx.GraphDef, rest: nnx.State,
                    optimizer: optax.GradientTransformation, loss: Callable, *,
                    grad_accum: int = 1,
                    state_sharding=None, mesh: jax.sharding.Mesh | None = None,
                    load_balancing_weight: float = _TRAIN.load_balancing_weight,
                    router_z_weight: float = _TRAIN.router_z_weight,
                    router_bias_rate: float = _TRAIN.router_bias_rate) -> Callable:
    """Compile `(state, batch) -> (state, metrics)`; a non-finite step is skipped (see the
    module docstring).

    loss: `(model, batch, rng) -> (loss_sum, count, metric_sums)`, an objective's loss
      (`tfx.train.objectives.Objective.loss`, tfx.train.losses). batch: dict of arrays with a
      leading [batch] axis divisible by grad_accum. metrics: float32 scalars "loss" (mean
      over targets, plus the weighted MoE auxiliary losses of a model with experts),
      "grad_norm", "accuracy", the loss's own sums divided by their counts, and MOE_METRICS
      for a model with experts.
    state_sharding: a TrainState of shardings to keep the state on (tfx.parallel); the state
      argument is donated.
    mesh: the mesh the step is traced under; mixture-of-experts layers split their experts
      over its "expert" axis (expert parallelism). With `state_sharding`, a mesh whose
      "expert" or "tensor" axis splits no parameter is refused (a ValueError naming it,
      `tfx.parallel.check_mesh_use`).
    load_balancing_weight, router_z_weight, router_bias_rate: a model with experts' training
      settings (tfx.train.config.TrainConfig): the weights of its routing losses in the loss,
      and the step of its "deepseek" selection biases.
    """
    if mesh is not None and state_sharding is not None:
        check_mesh_use(state_sharding, mesh)

    def sums_and_grads(params, frozen, batch, rng):
        def loss_sum(p):
            model = _merge(graphdef, p, frozen, rest, rng, train=True)
            total, count, metrics = loss(model, batch, jax.random.fold_in(rng, 0))
            total, metrics = add_moe_losses(model, total, count, metrics,
                                            load_balancing_weight=load_balancing_weight,
                                            router_z_weight=router_z_weight)
            return total, (count, metrics, expert_loads(model))
        (total, (count, metrics, loads)), grads = jax.value_and_grad(loss_sum,
                                                                     has_aux=True)(params)
        return grads, total, count, metrics, loads

    @_under(mesh)
    def train_step(state: TrainState, batch: dict):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, total, count, sums, loads = _accumulated(
            sums_and_grads, state.params, state.frozen, batch, rng, grad_accum)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if loads:
            params = balance_experts(state.params, params, loads, router_bias_rate)
        metrics = {"loss": total / count, "grad_norm": optax.tree.norm(grads),
                   **_ratios(sums)}
        return _advance(state, params, opt_state, metrics), metrics

    shardings = {} if state_sharding is None else {"out_shardings": (state_sharding, None)}
    return jax.jit(train_step, donate_argnums=0,
                   compiler_options=compiler_options(has_experts=_has_experts(rest)),
                   **shardings)


def _accumulated(sums_and_grads: Callable, params, frozen, batch: dict, rng, grad_accum: int):
    """`sums_and_grads(params, frozen, batch, rng)` summed over grad_accum micro-batches
    (one call when grad_accum is 1), under lax.scan so that one micro-batch is compiled."""
    if grad_accum == 1:
        return sums_and_grads(params, frozen, batch, rng)
    # Micro-batch i takes rows i, i + grad_accum, ...: strided, so that each micro-batch stays
    # spread over every device of a sharded batch axis.
    micro = jax.tree.map(lambda x: x.reshape(-1, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(carry, xs):
        index, micro_batch = xs
        out = sums_and_grads(params, frozen, micro_batch, jax.random.fold_in(rng, index))
        return jax.tree.map(jnp.add, carry, out), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        sums_and_grads, params, frozen, jax.tree.map(lambda x: x[0], micro), rng))
    out, _ = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum), micro))
    return out


def _advance(state: TrainState, params, opt_state, metrics: dict) -> TrainState:
    """The state after a step: its new params and opt_state only when its loss, gradient norm
    and new params are all finite, else the old ones; the step number advances and `nonfinite`
    counts either way. A conditional, not a select per leaf: XLA copied the scalar `finite`
    (one `and` per leaf) into every leaf's update fusion, so compiling grew with the square of
    the number of leaves (gpt-6x384's step 12.3 s -> 8 s; a 1-layer T5 9.5 s -> 5.4 s)."""
    finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
              & _all_finite(params))
    params, opt_state = jax.lax.cond(finite, lambda: (params, opt_state),
                                     lambda: (state.params, state.opt_state))
    return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state,
                               nonfinite=state.nonfinite.count(finite, state.step + 1))


def _all_finite(tree) -> jax.Array:
    """bool []: every element of every leaf is finite (exact, unlike a norm, which overflows
    to inf on large finite values)."""
    return functools.reduce(jnp.logical_and, (jnp.isfinite(x).all() for x in
                                              jax.tree.leaves(tree)), jnp.bool_(True))


def _under(mesh):
    """Decorator: trace the function with `mesh` as the abstract mesh (None: unchanged)."""
    def wrap(fn):
        if mesh is None:
            return fn

        @functools.wraps(fn)
        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)
        return traced
    return wrap


def _has_experts(rest: nnx.State) -> bool:
    """Whether the model has MoE layers (they record routing losses in its non-Param state)."""
    return any(path_name(path).endswith("load_balancing_loss")
               for path, _ in jax.tree.leaves_with_path(rest))


def compiler_options(*, has_experts: bool) -> dict | None:
    """On CPU, turn off XLA's YNNPACK fusions for models without experts: the training step's
    batched attention matmuls and their transposes run about 1.4x faster (6-layer/384 GPT,
    benchmarks/train.py). The grouped matmuls of MoE layers lose more without them (1.35x on
    the layer, benchmarks/moe.py; moe_gpt's step 0.79 s with them, 0.85 s without), so models
    with experts keep XLA's defaults."""
    if jax.default_backend() != "cpu" or has_experts:
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def make_eval_step(graphdef: nnx.GraphDef, rest: nnx.State, loss: Callable, *,
                   mesh: jax.sharding.Mesh | None = None) -> Callable:
    """Compile `(state, batch, rng) -> (loss_sum, count, metric_sums)` in eval mode (no
    dropout), for a TrainState (its params and frozen weights); sum these over batches and
    divide (see `finish_eval`). loss, mesh: as in `make_train_step`."""

    @jax.jit
    @_under(mesh)
    def eval_step(state: TrainState, batch, rng):
        model = _merge(graphdef, state.params, state.frozen, rest, rng, train=False)
        return loss(model, batch, rng)

    return eval_step


def finish_eval(results: list) -> dict:
    """Per-batch (loss_sum, count, metric_sums) -> {"loss": mean, "accuracy", ...}."""
    total, count, sums = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), results)
    count = max(float(count), 1.0)
    return {"loss": float(total) / count,
            **{k: float(v) for k, v in _ratios(sums).items()}}


def _ratios(sums: dict) -> dict:
    """Metric sums -> rates: correct/targets -> accuracy, exact/sequences -> exact_match, MoE
    loss sums / targets -> their means, preference rewards and log-probs / pairs -> theirs."""
    out = {name: sums[name] / jnp.maximum(sums["targets"], 1.0) for name in MOE_METRICS
           if name in sums}
    if "correct" in sums:
        out["accuracy"] = sums["correct"] / jnp.maximum(sums["targets"], 1.0)
    if "exact" in sums:
        out["exact_match"] = sums["exact"] / jnp.maximum(sums["sequences"], 1.0)
    if "pairs" in sums:  # preference tuning: per-pair means of its rewards and log-probs
        out |= {name: value / jnp.maximum(sums["pairs"], 1.0) for name, value in sums.items()
                if name.startswith(("rewards_", "logps_"))}
    return out
