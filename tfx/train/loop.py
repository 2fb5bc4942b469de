"""The training loop behind `tfx train`: resumable, interruptible, logged.

`train(experiment, workdir)` builds the model, restores the newest good checkpoint in
WORKDIR/checkpoints (if any), and runs steps until `train.steps`, logging to
WORKDIR/metrics.jsonl and TensorBoard, evaluating, checkpointing, and finally plotting
WORKDIR/loss.png. Batch k and the random key of step k depend only on (seed, k), so a run that
is interrupted and resumed ends exactly where an uninterrupted run ends. SIGTERM/SIGINT finish
the current step, save a checkpoint and return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from pathlib import Path

import jax
from flax import nnx
from tqdm.auto import tqdm

from tfx import parallel
from tfx.models.presets import create
from tfx.peft import PeftParam
from tfx.train.checkpoint import Checkpoints
from tfx.train.config import Experiment, run_identity
from tfx.train.feed import Feed
from tfx.train.flops import matmul_peak_flops, parameter_count, training_flops_per_token
from tfx.train.metrics import MetricsWriter, plot_losses, read_metrics
from tfx.train.objectives import OBJECTIVE_FUNCTIONS
from tfx.train.optim import make_optimizer
from tfx.train.pretrained import pretrained_params
from tfx.train.step import (
    TrainState,
    finish_eval,
    init_train_state,
    make_eval_step,
    make_train_step,
)

__all__ = ["TrainResult", "Trainer", "train"]


@dataclasses.dataclass
class TrainResult:
    """How a call to `train` ended: the step reached, whether a signal stopped it early, and
    the last validation metrics."""

    step: int
    interrupted: bool
    validation: dict


class Trainer:
    """An experiment's model, train state and compiled steps (shared by `train`, `tfx eval`
    and `tfx sample`). sharded: with several devices, spread the state and batches over the
    mesh of `experiment.mesh`; False keeps everything on the default device."""

    def __init__(self, experiment: Experiment, workdir: str | Path, *, sharded: bool = True):
        self.experiment = experiment
        self.workdir = Path(workdir)
        self.feed = Feed(experiment)  # reads the data first: a bad path fails before any work
        self.checkpoints = Checkpoints(self.workdir / "checkpoints",
                                       config=run_identity(experiment),
                                       keep=experiment.train.keep_checkpoints)
        t = experiment.train
        model = create(experiment.model, rngs=nnx.Rngs(t.seed))
        if t.init_from is not None:
            nnx.update(model, pretrained_params(t.init_from, experiment.model))
        method = experiment.peft.settings()
        if method is not None:  # fine-tune only what the method adds
            method.attach(model, rngs=nnx.Rngs(t.seed + 1))
        self.optimizer = make_optimizer(experiment.optim, t.steps)
        self.graphdef, self.rest, self.state = init_train_state(
            model, self.optimizer, seed=t.seed,
            trainable=nnx.Param if method is None else PeftParam)
        self.state_sharding = self.batch_sharding = mesh = None
        if sharded and jax.device_count() > 1:  # one device: plain jit, no mesh
            mesh = parallel.mesh_from_config(experiment.mesh)
            rows = t.grad_accum * mesh.size // mesh.shape["tensor"]
            if t.batch_size % rows:
                raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of "
                                 f"grad_accum x data x fsdp x expert = {rows}")
            self.state_sharding = parallel.state_shardings(self.state, mesh)
            self.batch_sharding = parallel.batch_sharding(mesh)
            self.state = parallel.shard(self.state, self.state_sharding)
        objective = OBJECTIVE_FUNCTIONS[experiment.objective]
        kwargs = {"label_smoothing": experiment.label_smoothing,
                  "mlm_probability": experiment.mlm_probability}
        self.train_step = make_train_step(self.graphdef, self.rest, self.optimizer, objective,
                                          grad_accum=t.grad_accum, objective_kwargs=kwargs,
                                          state_sharding=self.state_sharding, mesh=mesh)
        self.eval_step = make_eval_step(self.graphdef, self.rest, objective,
                                        objective_kwargs=kwargs, mesh=mesh)

    def restore(self) -> int:
        """Load the newest readable checkpoint into `self.state`; the step it holds (0: none)."""
        template = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            self.state.to_dict())
        restored = self.checkpoints.restore(template)
        if restored is None:
            return 0
        step, values = restored
        self.state = TrainState(**values, frozen=self.state.frozen)
        return step

    def model(self) -> nnx.Module:
        """The model with the current parameters, in eval mode."""
        model = nnx.merge(self.graphdef, self.state.params, self.state.frozen, self.rest)
        model.eval()
        return model

    def evaluate(self) -> dict:
        """Validation metrics over the fixed validation batches."""
        rng = jax.random.key(self.experiment.train.seed + 1)
        results = [self.eval_step(self.state, self._device(batch),
                                  jax.random.fold_in(rng, i))
                   for i, batch in enumerate(self.feed.validation())]
        return finish_eval(results)

    def _device(self, batch: dict):
        """A numpy batch (the same in every process) -> device arrays, sharded by rows."""
        if self.batch_sharding is None:
            return jax.device_put(batch)
        rows = parallel.process_rows(batch, self.batch_sharding)
        return parallel.global_batch(rows, self.batch_sharding)

    def close(self) -> None:
        self.checkpoints.close()


def train(experiment: Experiment, workdir: str | Path, *, progress: bool = True) -> TrainResult:
    """Train (or resume training) `experiment` in `workdir`; see the module docstring."""
    trainer = Trainer(experiment, workdir)
    try:
        return _run(trainer, progress=progress)
    finally:
        trainer.close()


def _run(trainer: Trainer, *, progress: bool) -> TrainResult:
    e, t = trainer.experiment, trainer.experiment.train
    start = trainer.restore()
    lead = jax.process_index() == 0  # the process that logs
    writer = MetricsWriter(trainer.workdir, resume_step=start, enabled=lead)
    flops_per_step = trainer.feed.tokens_per_batch * training_flops_per_token(
        e.model, parameter_count(trainer.state.params, config=e.model)
        + parameter_count(trainer.state.frozen, config=e.model), t.seq_len)
    peak = matmul_peak_flops()
    validation, step = {}, start
    bar = tqdm(total=t.steps, initial=start, desc=e.name, disable=not (progress and lead),
               dynamic_ncols=True)
    say = bar.write if lead else lambda _: None
    with writer, bar, _stop_on_signal() as stop:
        clock, clock_step = time.perf_counter(), start
        for step in range(start + 1, t.steps + 1):
            trainer.state, metrics = trainer.train_step(
                trainer.state, trainer._device(trainer.feed.train(step - 1)))
            bar.update()
            if step % t.log_every == 0 or step == t.steps:
                metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
                seconds = (time.perf_counter() - clock) / (step - clock_step)
                metrics["tokens_per_s"] = trainer.feed.tokens_per_batch / seconds
                metrics["mfu"] = flops_per_step / seconds / peak
                writer.write(step, metrics)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}",
                                mfu=f"{metrics['mfu']:.0%}")
                clock, clock_step = time.perf_counter(), step
            if step % t.eval_every == 0 or step == t.steps:
                validation = trainer.evaluate()
                writer.write(step, validation, split="val")
                say(f"step {step}: " + ", ".join(f"val {k} {v:.4g}"
                                                 for k, v in validation.items()))
                clock, clock_step = time.perf_counter(), step  # tokens/s leaves eval out
            if step % t.checkpoint_every == 0 or step == t.steps or stop.is_set():
                trainer.checkpoints.save(step, trainer.state.to_dict())
                clock, clock_step = time.perf_counter(), step
            if stop.is_set():
                say(f"stopped by a signal after step {step}; the same command resumes")
                break
    interrupted = stop.is_set()
    if lead:
        plot_losses(read_metrics(writer.path), trainer.workdir / "loss.png", title=e.name)
    return TrainResult(step=step, interrupted=interrupted, validation=validation)


@contextlib.contextmanager
def _stop_on_signal():
    """An Event set by the first SIGTERM/SIGINT (the loop then saves and stops); a second
    signal gets the previous handler's behaviour."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        if stop.is_set():
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        stop.set()

    for s in previous:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

