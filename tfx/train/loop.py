"""The training loop behind `tfx train`: resumable, interruptible, logged.

`train(experiment, workdir)` builds the model, restores the newest good checkpoint in
WORKDIR/checkpoints (if any), and runs steps until `train.steps`, logging to
WORKDIR/metrics.jsonl and TensorBoard, evaluating, checkpointing, and finally plotting
WORKDIR/loss.png. Batch k and the random key of step k depend only on (seed, k), so a run that
is interrupted and resumed ends exactly where an uninterrupted run ends. SIGTERM/SIGINT finish
the current step, save a checkpoint and return (`TrainResult.signal` names the signal); from the
restore to the last save's commit they only set a flag that the loop reads between steps (one
that comes before the first step stops the run without saving), and a second one gets the
handler that was there before (`tfx train`'s stops at once, keeping the newest committed step).

What the loop guarantees about the workdir:
- One run at a time: `train` holds WORKDIR/.lock (tfx.train.lock) from before it opens the
  checkpoints and metrics until its last save has committed; a second run is refused at once.
- One config per workdir: a run resumes only with the config it started with (loop-only
  settings aside, tfx.train.config.LOOP_ONLY); another is refused before anything is written,
  naming the differing fields and, when the stored run can be a starting point, the
  `--init-from` command that trains on from its weights. train.steps belongs to the config:
  the learning-rate schedule spans it, so a run is never extended in place.
- No non-finite state is ever saved: a step with a non-finite loss, gradient norm or update is
  not applied (tfx.train.step), and the loop reads the device-side count of such steps at
  every log, eval and checkpoint step, before it writes anything. With train.nonfinite="stop"
  it then raises `DivergenceError` without saving, so every checkpoint on disk (and so every
  one that keep-K counts) is from before the first non-finite step; with "skip" it logs the
  count and goes on, and stops the same way after more than train.max_consecutive_skips
  skipped steps in a row.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import jax
from flax import nnx
from tqdm.auto import tqdm

from tfx import parallel
from tfx.train.checkpoint import Checkpoints, ConfigMismatchError
from tfx.train.config import Experiment, non_empty_path, run_identity, stored_identity
from tfx.train.flops import (
    matmul_peak_flops,
    nominal_peak_flops,
    parameter_count,
    training_flops_per_token,
)
from tfx.train.lock import WorkdirLock
from tfx.train.metrics import MetricsWriter, plot_losses, read_metrics
from tfx.train.objectives import get_objective
from tfx.train.optim import make_optimizer
from tfx.train.pretrained import adopt_base
from tfx.train.run import initial_model, stored_experiment
from tfx.train.signals import StopFlag, handling
from tfx.train.step import (
    finish_eval,
    init_train_state,
    make_eval_step,
    make_train_step,
    restore_template,
)

__all__ = ["DivergenceError", "TrainResult", "Trainer", "train"]


class DivergenceError(RuntimeError):
    """Training met non-finite losses (train.nonfinite): the run stopped without saving that
    state; the newest checkpoint is from before the first such step."""


@dataclasses.dataclass
class TrainResult:
    """How a call to `train` ended.

    step: the step reached. signal: the number of the signal (`signal.SIGINT`, `signal.SIGTERM`)
    that came while the run restored, trained, saved or plotted, None when none did (`tfx train`
    then exits with 128 + that number: 130, 143); when `step` < train.steps it stopped the run,
    after saving that step. validation: the last validation metrics. artifacts: where the run's
    files are, {"checkpoints": folder (config.json and a folder per saved step), "metrics":
    metrics.jsonl (one JSON record per log or eval step), "loss_plot": loss.png, "tensorboard":
    folder of TensorBoard event files}; the last three are written by process 0 only.
    """

    step: int
    signal: int | None
    validation: dict
    artifacts: dict[str, Path]

    @property
    def interrupted(self) -> bool:
        """Whether a signal stopped the run (before or at train.steps)."""
        return self.signal is not None


class Trainer:
    """An experiment's model, train state and compiled steps (shared by `train` and `tfx eval`;
    `tfx.train.load_run` loads a model alone). sharded: with several devices, spread the
    state and batches over the mesh of `experiment.mesh`; False keeps everything on the
    default device. lock: open the workdir to train in it: take its exclusive lock (the first
    process of a multi-process run takes it) before opening its checkpoints for writing;
    `close` releases it. Without it the checkpoints are opened read-only (evaluation), so a
    run training in the same workdir keeps its in-flight save."""

    def __init__(self, experiment: Experiment, workdir: str | Path, *, sharded: bool = True,
                 lock: bool = False):
        non_empty_path("workdir", workdir)
        self.experiment = experiment
        self.workdir = Path(workdir)
        self.objective = get_objective(experiment.objective)
        # Reads the data first: a bad path fails before any work. Then the model and its
        # steps: a base of another model or a LoRA target that matches nothing is refused
        # before the workdir is touched (no config.json left behind to block the corrected
        # command).
        self.feed = self.objective.batches(experiment)
        self._build(sharded)
        self._lock = WorkdirLock(self.workdir)
        if lock and jax.process_index() == 0:
            self._lock.acquire()
        try:
            self.checkpoints = Checkpoints(self.workdir / "checkpoints",
                                           config=run_identity(experiment),
                                           keep=experiment.train.keep_checkpoints,
                                           read_only=not lock, stored_form=stored_identity)
        except ConfigMismatchError as error:
            self._lock.release()
            if not lock:
                raise
            raise ValueError(_refused_resume(self.workdir, experiment, error.differences)
                             ) from None
        except BaseException:
            self._lock.release()
            raise

    def _build(self, sharded: bool) -> None:
        """The model, the train state (placed on the mesh) and the compiled steps."""
        experiment, t = self.experiment, self.experiment.train
        model, trainable = initial_model(experiment)
        self.objective.prepare(self.feed, model)  # e.g. DPO's reference log-probs
        self.optimizer = make_optimizer(experiment.optim, t.steps)
        self.graphdef, self.rest, self.state = init_train_state(
            model, self.optimizer, seed=t.seed, trainable=trainable)
        self.state_sharding = self.batch_sharding = mesh = None
        if sharded and jax.device_count() > 1:  # one device: plain jit, no mesh
            mesh = parallel.mesh_from_config(experiment.mesh)
            rows = t.grad_accum * mesh.size // (mesh.shape["tensor"] * mesh.shape["sequence"])
            if t.batch_size % rows:
                raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of "
                                 f"grad_accum x data x fsdp x expert = {rows}")
            self.state_sharding = parallel.state_shardings(self.state, mesh)
            self.batch_sharding = parallel.batch_sharding(mesh)
            self.state = parallel.shard(self.state, self.state_sharding)
        else:
            # Committed to the device, as the step's outputs are: a state of uncommitted arrays
            # (a LoRA run's new factors) would compile the step a second time at step 2.
            self.state = jax.device_put(self.state, jax.devices()[0])
        loss = self.objective.loss(experiment)
        self.train_step = make_train_step(self.graphdef, self.rest, self.optimizer, loss,
                                          grad_accum=t.grad_accum,
                                          state_sharding=self.state_sharding, mesh=mesh,
                                          load_balancing_weight=t.load_balancing_weight,
                                          router_z_weight=t.router_z_weight,
                                          router_bias_rate=t.router_bias_rate)
        self.eval_step = make_eval_step(self.graphdef, self.rest, loss, mesh=mesh)

    def restore(self, *, strict: bool = False) -> int:
        """Load the newest readable checkpoint into `self.state`; the step it holds (0: none).

        strict: refuse a damaged newest checkpoint (`CorruptCheckpointError`) instead of
          falling back to an older step, as evaluation and sampling do.
        """
        restored = self.checkpoints.restore(restore_template(self.state), strict=strict)
        if restored is None:
            return 0
        step, values = restored
        self.state = dataclasses.replace(self.state, **values)  # frozen weights and counters stay
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

    def train_batch(self, step: int):
        """Training batch `step` on the devices. In a multi-process run each process builds
        only its own rows where its feed can (`reads_rows`: token shards read only their
        windows), else its rows of the global batch."""
        if self.batch_sharding is None or jax.process_count() == 1 or \
                not getattr(self.feed, "reads_rows", False):
            return self._device(self.feed.train(step))
        rows = parallel.process_row_range(self.experiment.train.batch_size, self.batch_sharding)
        return parallel.global_batch(self.feed.train(step, rows=rows), self.batch_sharding)

    def _device(self, batch: dict):
        """A numpy batch (the same in every process) -> device arrays, sharded by rows."""
        if self.batch_sharding is None:
            return jax.device_put(batch)
        rows = parallel.process_rows(batch, self.batch_sharding)
        return parallel.global_batch(rows, self.batch_sharding)

    def close(self) -> None:
        """Wait for pending saves, then release orbax's threads and the workdir's lock."""
        try:
            self.checkpoints.close()
        finally:
            self._lock.release()


def train(experiment: Experiment, workdir: str | Path, *, progress: bool = True) -> TrainResult:
    """Train (or resume training) `experiment` in `workdir`; see the module docstring.
    A `train.init_from` that is a Hugging Face folder gives the model and tokenizer
    (`tfx.train.pretrained.adopt_base`).

    Raises:
      ValueError: a bad config or data path, a workdir that holds another config's run, or
        one that another run is using (`tfx.train.lock.WorkdirBusyError`, naming its process).
      OSError: naming the workdir or file that cannot be written (read-only, full disk).
      DivergenceError: non-finite steps (see train.nonfinite); that state is not saved.
    """
    trainer = Trainer(adopt_base(experiment), workdir, lock=True)
    # From the restore to the last save's commit a signal only sets a flag, read at step
    # boundaries: raised as KeyboardInterrupt it could land inside XLA's or orbax's callbacks
    # and asyncio loops (tracebacks from their threads, a crash at exit, a swallowed Ctrl-C).
    with handling(StopFlag()) as stop:
        try:
            return _run(trainer, stop, progress=progress)
        finally:
            trainer.close()


def _run(trainer: Trainer, stop: StopFlag, *, progress: bool) -> TrainResult:
    e, t = trainer.experiment, trainer.experiment.train
    start = trainer.restore()
    lead = jax.process_index() == 0  # the process that logs
    writer = MetricsWriter(trainer.workdir, resume_step=start, enabled=lead)
    bar = tqdm(total=t.steps, initial=start, desc=e.name, disable=not (progress and lead),
               dynamic_ncols=True)
    say = bar.write if lead else lambda _: None
    if start:
        say(f"resumed from step {start}")
    boundaries, step = _Boundaries(trainer, writer, bar, say), start
    with writer, bar:
        boundaries.clock.reset(start)
        # A signal before the first step (while restoring) leaves nothing new to save.
        for step in range(start + 1, t.steps + 1) if stop.signum is None else ():
            trainer.state, metrics = trainer.train_step(
                trainer.state, trainer.train_batch(step - 1))
            bar.update()
            trainer.checkpoints.check()  # a failed background save stops the run at once
            stopping = stop.signum is not None  # read once: a later signal must still save
            if stopping:
                name = signal.Signals(stop.signum).name
                say(f"{name}: saving step {step}, then stopping (a second {name} stops at "
                    "once)")
            boundaries.after(step, metrics, save=stopping)
            if stopping:
                break
    artifacts = _artifacts(trainer.workdir)
    if lead:
        plot_losses(read_metrics(writer.path), artifacts["loss_plot"], title=e.name)
    return TrainResult(step=step, signal=stop.signum, validation=boundaries.validation,
                       artifacts=artifacts)


def _artifacts(workdir: Path) -> dict[str, Path]:
    """Where the files of the run in `workdir` are (TrainResult.artifacts): the folders and
    names that Checkpoints and MetricsWriter use, and the loss plot's."""
    return {"checkpoints": workdir / "checkpoints", "metrics": workdir / "metrics.jsonl",
            "loss_plot": workdir / "loss.png", "tensorboard": workdir / "tensorboard"}


def _refused_resume(workdir: Path, experiment: Experiment, differences: list) -> str:
    """Why `train` does not resume the run in `workdir` with `experiment`, and how to go on.
    differences: (dotted key, stored value, new value), as `ConfigMismatchError` lists them."""
    changed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in differences)
    message = (f"{workdir} holds a run of another config, and a run resumes only with the "
               f"config it started with; differing fields (stored -> this run): {changed}. ")
    stored = stored_experiment(workdir)
    if stored.model != experiment.model or stored.peft.settings() is not None:
        return message + "Train this config in a new --workdir."
    message += (f"To train on from its newest checkpoint, start a new run from it: `tfx train "
                f"{experiment.name} --workdir NEW_WORKDIR --init-from {workdir}` with these "
                "options (train.init_from: its weights, with a new optimiser state and "
                "learning-rate schedule; --steps counts the new run's steps).")
    if any(key == "train.steps" for key, _, _ in differences):
        message += (" A run is not extended in place: its learning-rate schedule spans its "
                    "train.steps, so raising them would change the steps it has already taken.")
    return message


class _Boundaries:
    """What the loop does after the steps that log, evaluate or save (every train.log_every,
    eval_every and checkpoint_every steps, the last step, and the step a signal stops at);
    the steps between them never wait for the device."""

    def __init__(self, trainer: Trainer, writer: MetricsWriter, bar: tqdm,
                 say: Callable[[str], None]):
        self.trainer, self.writer, self.bar, self.say = trainer, writer, bar, say
        self.clock, self.guard = _Clock(trainer), _Guard(trainer, say)
        self.validation: dict = {}  # the last validation metrics

    def after(self, step: int, metrics: dict, *, save: bool = False) -> None:
        """Log, evaluate and save as step `step` asks (`save`: save it anyway). metrics:
        the step's device scalars."""
        t = self.trainer.experiment.train
        log = step % t.log_every == 0 or step == t.steps
        evaluate = step % t.eval_every == 0 or step == t.steps
        save = save or step % t.checkpoint_every == 0 or step == t.steps
        if not (log or evaluate or save):
            return
        skipped = self.guard.check(step)  # before anything of this state is written
        if log:
            metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
            metrics.update(self.clock.rates(step), skipped_steps=skipped)
            self.writer.write(step, metrics)
            self.bar.set_postfix_str(self.clock.describe(metrics))
        if evaluate:
            self.validation = self.trainer.evaluate()
            self.writer.write(step, self.validation, split="val")
            self.say(f"step {step}: " + ", ".join(f"val {k} {v:.4g}"
                                                  for k, v in self.validation.items()))
        if save:
            self.trainer.checkpoints.save(step, self.trainer.state.to_dict())
        self.clock.reset(step)  # tokens/s leaves evaluation and checkpointing out


class _Clock:
    """Training throughput since the last reset: tokens/s and model FLOPs utilisation, against
    the devices' nominal peak where tfx.train.flops knows it ("mfu", as MaxText reports it)
    and against the matmul peak measured when the run starts ("mfu_measured")."""

    def __init__(self, trainer: Trainer):
        e, state = trainer.experiment, trainer.state
        self.tokens = trainer.feed.tokens_per_batch
        self.flops = self.tokens * training_flops_per_token(
            e.model, parameter_count(state.params, config=e.model)
            + parameter_count(state.frozen, config=e.model), e.train.seq_len)
        # The step runs on every device (one device's peak would count the others' work).
        self.peaks = {"mfu_measured": matmul_peak_flops() * jax.device_count()}
        nominal = nominal_peak_flops(jax.devices()[0].device_kind)
        if nominal is not None:
            self.peaks["mfu"] = nominal * jax.device_count()
        self.reset(0)

    def reset(self, step: int) -> None:
        self.time, self.step = time.perf_counter(), step

    def rates(self, step: int) -> dict:
        seconds = (time.perf_counter() - self.time) / (step - self.step)
        return {"tokens_per_s": self.tokens / seconds,
                **{name: self.flops / seconds / peak for name, peak in self.peaks.items()}}

    @staticmethod
    def describe(metrics: dict) -> str:
        """The progress bar's text for logged `metrics` (loss, tokens_per_s, mfu_measured and,
        where the device's nominal peak is known, mfu)."""
        measured = f"{metrics['mfu_measured']:.0%} of measured peak"
        mfu = (f"MFU {metrics['mfu']:.0%} of bf16 peak ({measured})" if "mfu" in metrics
               else f"MFU {measured}")
        return f"loss={metrics['loss']:.3f}, tok/s={metrics['tokens_per_s']:.0f}, {mfu}"


class _Guard:
    """train.nonfinite, applied where the loop meets the device anyway (log, eval and
    checkpoint steps): reads the state's counters of skipped steps (four int32 scalars), says
    when new ones appear, and raises DivergenceError when the run must stop."""

    def __init__(self, trainer: Trainer, say: Callable[[str], None]):
        self.trainer, self.say, self.reported = trainer, say, 0

    def check(self, step: int) -> int:
        """The number of steps skipped so far (since the run started or resumed)."""
        t = self.trainer.experiment.train
        counts = jax.device_get(self.trainer.state.nonfinite)
        skipped, first, longest = int(counts.skipped), int(counts.first), int(counts.longest)
        if skipped and t.nonfinite == "stop":
            self._stop(step, f"step {first} had a non-finite loss, gradient norm or update")
        if longest > t.max_consecutive_skips:
            self._stop(step, f"{longest} steps in a row had a non-finite loss, gradient norm "
                             f"or update (train.max_consecutive_skips = "
                             f"{t.max_consecutive_skips})")
        if skipped > self.reported:
            self.say(f"step {step}: skipped {skipped} step(s) with a non-finite loss, gradient "
                     f"norm or update so far (the first: step {first})")
            self.reported = skipped
        return skipped

    def _stop(self, step: int, why: str) -> NoReturn:
        newest = self.trainer.checkpoints.latest_step()
        kept = "no checkpoint yet" if newest is None else f"the newest checkpoint: step {newest}"
        # A lower learning rate is another run (another config): it needs a new workdir.
        hint = "Lower optim.learning_rate in a new workdir"
        if self.trainer.experiment.train.nonfinite == "stop":
            hint += ", or resume with train.nonfinite=skip to skip such steps"
        raise DivergenceError(f"training diverged: {why}; stopped at step {step} without "
                              f"saving ({kept}). {hint}")
