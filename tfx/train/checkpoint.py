"""Checkpoints of one training run: orbax's CheckpointManager plus a config guard and fallback.

Layout of a run's checkpoint directory (WORKDIR/checkpoints)::

    config.json       the run's experiment config, written once; a later run with another
                      config in the same directory is refused before anything is written
    <step>/           one orbax checkpoint per saved step (the newest `keep` are kept):
      default/        the state's arrays
      checksums/      a checksum of every array (`tfx.train.checksums`), verified on restore

The state is any pytree of jax arrays (sharded or not), numpy arrays and python scalars,
e.g. ``{"params": nnx.State, "opt_state": optax state, "step": int32[], "rng": key}``.
PRNG keys are stored as their key data (``jax.random.key_data``: uint32 [..., 2] for the
default threefry): a typed key (``jax.random.key``) in the state restores as a typed key when
the template holds one, and a raw uint32 key-data array restores as that array.

Orbax writes each step into a temporary directory and renames it only once complete, so a
save that dies half way (crash, SIGKILL, full disk) never replaces an earlier step, and old
steps are deleted only after the new one has committed. Temporary leftovers are removed when
the next `Checkpoints` opens the directory. Both items of a step commit together, so a
committed step always has its checksums. A step that `restore` finds unreadable or whose
arrays do not match their checksums stays on disk (a read error may be passing) until a new
save of that step replaces it or it rotates out. Steps written before checksums existed (no
``checksums/`` item) restore unverified, with a warning.

A background save that fails is reported by the next `check`, `save` or `wait`; it never
deletes or replaces an earlier step.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from tfx.nn.paths import path_name
from tfx.train import checksums

_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float)
# Item names inside a step: "default" is what orbax named the only item of steps written
# before checksums were added, so those steps read as new ones without their checksums.
_STATE, _CHECKSUMS = "default", "checksums"


class CorruptCheckpointError(ValueError):
    """A checkpoint step is unreadable or its arrays do not match their checksums."""


class ConfigMismatchError(ValueError):
    """A checkpoint directory holds another config's run. differences: (dotted key, stored
    value, new value) for every leaf where the configs differ."""

    def __init__(self, message: str, differences: list[tuple[str, Any, Any]]):
        super().__init__(message)
        self.differences = differences


class Checkpoints:
    """Checkpoints of one training run in `directory` (= WORKDIR/checkpoints).

    Args:
      directory: the run's checkpoint folder; created if missing.
      config: the run's JSON-able experiment config, written to ``directory/config.json``
        when the directory is first opened; if that file already holds a different config,
        ConfigMismatchError (a ValueError) lists the differing keys (dotted paths, old vs new)
        and nothing is written.
      keep: how many of the newest steps to keep (>= 1).
      async_save: write in a background thread; `save` returns once the arrays are copied
        to host memory. Call `wait` (or `close`) before reading the files from elsewhere,
        and `check` after every training step to hear of a failed write at once.
      read_only: only restore (`tfx eval`, `tfx sample`, `train.init_from`): nothing in the
        directory is created, written or deleted — in particular not the temporary folder of
        a save that a running training run has in flight, which a writer's opening removes.
      stored_form: applied to the config read from ``config.json`` before it is compared with
        `config` (`tfx.train.config.stored_identity`: a config of an older layout is migrated);
        None compares it as read.
    """

    def __init__(self, directory: str | os.PathLike, *, config: dict, keep: int = 3,
                 async_save: bool = True, read_only: bool = False,
                 stored_form: Callable[[dict], dict] | None = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if not isinstance(config, dict):
            raise TypeError(f"config must be a JSON-able dict, got {type(config).__name__}")
        try:
            config = json.loads(json.dumps(config))  # tuples -> lists, as they will be read back
        except (TypeError, ValueError) as e:
            raise TypeError(f"config must be JSON-able: {e}") from e
        self.directory = pathlib.Path(directory).absolute()
        config_path = self.directory / "config.json"
        if config_path.exists():
            _check_same_config(config_path, config, stored_form)
        self.read_only = read_only
        self._manager = _manager(self.directory, keep=keep, async_save=async_save,
                                 read_only=read_only)
        if not (read_only or config_path.exists()) and jax.process_index() == 0:
            tmp = config_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, config_path)  # atomic: a reader sees no half-written config
        self._unreadable: set[int] = set()  # steps that `restore` could not read
        self._pending: int | None = None  # the step of the latest save, named in its errors

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` and its checksums as checkpoint `step`, then delete all but the newest
        `keep` steps (only once the new step has committed).

        Args:
          step: the training step, an int >= 0. A step that already exists raises ValueError,
            unless `restore` found it unreadable: then it is replaced.
          state: pytree whose leaves are jax arrays (any sharding), numpy arrays or python
            scalars.
          force: passed to orbax; with the default options every step is saved anyway.
        Returns:
          True when a save was started (orbax's answer).
        Raises:
          TypeError: a leaf of another type (checked before anything is written).
          Exception: errors from orbax (e.g. a deleted array, or a failed background write
            surfaced here from the previous save), with a note naming the step; earlier steps
            stay intact.
        """
        if self.read_only:
            raise ValueError(f"these checkpoints of {self.directory} were opened read_only")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        bad = [(jax.tree_util.keystr(path), type(leaf).__name__)
               for path, leaf in jax.tree_util.tree_leaves_with_path(state)
               if not isinstance(leaf, _LEAF_TYPES)]
        if bad:
            raise TypeError("state leaves must be jax/numpy arrays or python scalars; got "
                            + ", ".join(f"{p}: {t}" for p, t in bad))
        self.wait()  # surface a failed background write of the previous step first
        if step in self._manager.all_steps():
            if step not in self._unreadable:
                raise ValueError(f"step {step} is already saved in {self.directory}")
            self._manager.delete(step)
        self._unreadable.discard(step)
        self._pending = step
        try:  # checksums of the arrays as they are now, before training changes them
            items = {_STATE: ocp.args.StandardSave(state),
                     _CHECKSUMS: ocp.args.JsonSave(checksums.record(state))}
            return self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        except Exception as e:
            e.add_note(f"while saving checkpoint step {step} in {self.directory}; "
                       "earlier steps are untouched")
            raise

    def restore(self, template: Any, step: int | None = None, *,
                strict: bool = False) -> tuple[int, Any] | None:
        """Restore a checkpoint into the structure, dtypes and shardings of `template`.

        Args:
          template: pytree like the saved state; leaves are concrete arrays/scalars or
            ``jax.ShapeDtypeStruct`` (with ``sharding=`` for jax arrays). Numpy leaves restore
            as numpy, jax leaves as jax.Array with the template's sharding.
          step: the step to restore; None means the newest readable one: when a checkpoint
            is unreadable (missing or truncated files, bad metadata, arrays that do not match
            their checksums) a warning names it and the error, and the next older step is
            tried.
          strict: never fall back: a newest (or requested) step that is unreadable raises
            CorruptCheckpointError. For readers such as `tfx eval`, which must not report
            the numbers of an older step as the newest one's.
        Returns:
          ``(step, state)``, or None when the directory holds no checkpoint.
        Raises:
          ValueError: the checkpoint's tree structure or shapes differ from `template` (a
            checkpoint of another model config), the requested `step` is missing, or no
            checkpoint at all is readable.
          CorruptCheckpointError: (a ValueError) the requested `step` is unreadable, or with
            `strict`, the newest one is.
        """
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {strict!r}")
        self.wait()
        steps = self.all_steps()[::-1]
        if step is not None:
            if step not in steps:
                raise ValueError(f"step {step} is not in {self.directory}; saved: {steps[::-1]}")
            steps = [step]
        if not steps:
            return None
        abstract = jax.tree.map(_abstract, template)
        errors = []
        for s in steps:
            try:
                mismatch, state = self._read(s, abstract)
            except Exception as e:
                self._unreadable.add(s)
                problem = f"checkpoint step {s} in {self.directory} is unreadable ({_brief(e)})"
                if strict or step is not None:  # a step asked for by name has no fallback
                    raise CorruptCheckpointError(problem + "; not falling back to an older "
                                                 "step") from e
                errors.append(f"step {s}: {_brief(e)}")
                warnings.warn(problem + "; trying the previous step", RuntimeWarning,
                              stacklevel=2)
                continue
            if mismatch:
                raise ValueError(f"checkpoint step {s} in {self.directory} does not match the "
                                 f"template (a checkpoint of another model config?): {mismatch}")
            return s, state
        raise ValueError(f"no readable checkpoint in {self.directory}:\n" + "\n".join(errors))

    def _read(self, step: int, abstract: Any) -> tuple[str, Any]:
        """(mismatch, state): where `abstract` differs from the step's tree ('' if nowhere),
        else the state read, verified against its checksums and cast to `abstract`'s dtypes.
        Raises whatever orbax raises on unreadable files, or CorruptCheckpointError."""
        metadata = self._manager.item_metadata(step)  # orbax reads the tree and array metadata
        stored = None if metadata is None else metadata.get(_STATE)
        if stored is None:
            raise FileNotFoundError("checkpoint metadata is missing")
        mismatch = _mismatch(abstract, stored.tree)
        if mismatch:
            return mismatch, None
        if _CHECKSUMS not in metadata:
            warnings.warn(f"checkpoint step {step} in {self.directory} has no checksums "
                          "(written before tfx saved them): restored unverified", stacklevel=3)
            items = {_STATE: ocp.args.StandardRestore(abstract)}
            return "", self._manager.restore(step, args=ocp.args.Composite(**items))[_STATE]
        # Read the arrays as stored, so that their checksums can be compared, then cast.
        items = {_STATE: ocp.args.StandardRestore(_as_stored(abstract, stored.tree)),
                 _CHECKSUMS: ocp.args.JsonRestore()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        bad = checksums.mismatches(restored[_STATE], restored[_CHECKSUMS])
        if bad:
            shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            raise CorruptCheckpointError(f"arrays differ from their checksums: {shown}")
        return "", jax.tree.map(_cast, restored[_STATE], abstract)

    def check(self) -> None:
        """Raise now if the background save has failed; never waits for one still writing.

        Cheap (a flag read when a save is in progress): call it after every training step.
        Raises the save's error with a note naming the step and the directory; the steps
        saved before it are kept (a failed save deletes none).
        """
        if not self._manager.is_saving_in_progress():
            self.wait()  # the background save is over: returns at once, or raises its error

    def wait(self) -> None:
        """Block until the pending background save has committed (re-raising its error)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            # orbax dropped the steps that this save would have rotated out from its list,
            # but they are still on disk: read the list again so that they stay usable.
            self._manager.reload()
            e.add_note(f"a background save of checkpoint step {self._pending} in "
                       f"{self.directory} failed; earlier steps are untouched")
            raise

    def close(self) -> None:
        """Wait for pending saves, then release orbax's threads."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _brief(error: Exception, limit: int = 300) -> str:
    """`error` on one line: TensorStore errors carry a many-line spec dump after the reason,
    which would push the rest of a one-line report (and the step it names) out of sight."""
    text = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(error).__name__}: {text}"


def _abstract(leaf: Any) -> Any:
    """Restore target of one template leaf: keeps shape, dtype (typed keys too) and sharding."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, np.ndarray):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf  # ShapeDtypeStruct or python scalar


def _as_stored(abstract: Any, stored: Any) -> Any:
    """`abstract` with each array leaf's dtype set to the checkpoint's (`stored`: orbax's tree
    metadata), so that the arrays read are the bits that were checksummed. A dtype that jax
    would narrow (float64 without jax_enable_x64) is read into host memory instead."""
    dtypes = {k: getattr(v, "dtype", None)
              for k, v in ocp.tree.to_flat_dict(stored, sep="/").items()}
    flat = ocp.tree.to_flat_dict(abstract, sep="/")
    for key, leaf in flat.items():
        dtype = dtypes.get(key)
        if (isinstance(leaf, jax.ShapeDtypeStruct) and dtype is not None and leaf.dtype != dtype
                and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)):
            narrowed = jax.dtypes.canonicalize_dtype(dtype) != dtype
            flat[key] = jax.ShapeDtypeStruct(leaf.shape, dtype,
                                             sharding=None if narrowed else leaf.sharding)
    return ocp.tree.from_flat_dict(flat, target=abstract, sep="/")


def _cast(value: Any, target: Any) -> Any:
    """A restored leaf in the dtype (and sharding) that its template leaf `target` asks for."""
    if not isinstance(target, jax.ShapeDtypeStruct) or value.dtype == target.dtype:
        return value
    value = value.astype(target.dtype)
    return value if target.sharding is None else jax.device_put(value, target.sharding)


def _stored_shape(leaf: Any) -> tuple[int, ...]:
    """Shape of a template leaf as stored on disk (typed keys are stored as key data)."""
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, leaf).shape
    return tuple(getattr(leaf, "shape", ()))  # python scalars are stored as 0-d


def _mismatch(abstract: Any, stored: Any) -> str:
    """Where the template's leaf paths and shapes differ from the checkpoint's ('' if nowhere)."""
    want = {path_name(k): _stored_shape(v) for k, v in ocp.tree.to_flat_dict(abstract).items()}
    have = {path_name(k): tuple(v.shape)
            for k, v in ocp.tree.to_flat_dict(stored).items() if v is not None}
    problems = [f"{k}: missing from the checkpoint" for k in want.keys() - have.keys()]
    problems += [f"{k}: not in the template" for k in have.keys() - want.keys()]
    problems += [f"{k}: shape {have[k]} in the checkpoint, {want[k]} in the template"
                 for k in want.keys() & have.keys() if want[k] != have[k]]
    return "; ".join(sorted(problems))


def _manager(directory: pathlib.Path, *, keep: int, async_save: bool,
             read_only: bool) -> ocp.CheckpointManager:
    """orbax's manager of `directory`: a writer keeping the newest `keep` steps, or a reader
    that creates, writes and deletes nothing (its temporary-folder cleanup included)."""
    if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                               save_interval_steps=0,
                                               cleanup_tmp_directories=False)
    else:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True, create=True)
    # orbax logs a warning at every read-only opening, which is what was asked for: keep it out
    # of `tfx eval` / `tfx sample` output.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR if read_only else level)
    try:
        # Naming the handlers lets a fresh manager read metadata before its first save or
        # restore.
        return ocp.CheckpointManager(
            directory, options=options,
            item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                           _CHECKSUMS: ocp.JsonCheckpointHandler()})
    finally:
        absl_logger.setLevel(level)


def _check_same_config(path: pathlib.Path, config: dict,
                       stored_form: Callable[[dict], dict] | None) -> None:
    """Raise ConfigMismatchError listing the dotted keys where `path`'s config (through
    `stored_form`) differs from `config`."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); refusing to reuse this directory") from e
    if stored_form is not None:
        try:
            old = json.loads(json.dumps(stored_form(old)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path} holds a config this tfx cannot read ({e}); refusing to "
                             "reuse this directory: train in a new workdir") from e
    diffs = config_diff(old, config, "")
    if diffs:
        raise ConfigMismatchError(f"{path.parent} holds checkpoints of another config; "
                                  "differing keys (old vs new): "
                                  + "; ".join(f"{k}: {o!r} vs {n!r}" for k, o, n in diffs), diffs)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def config_diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) for every leaf where two JSON trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{prefix}.{key}" if prefix else key
            out += config_diff(old.get(key, _MISSING), new.get(key, _MISSING), path)
        return out
    return [] if old == new else [(prefix or "<root>", old, new)]
