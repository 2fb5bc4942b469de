"""Loading a checkpoint into a model that is never initialised at random, tensor by tensor,
straight onto the devices (what `tfx.hf.load` does after checking the files' headers).

1. The model is traced, not built: `jax.make_jaxpr` of `create(config)` gives its structure
   (the nnx graph definition; the shape, dtype and logical axes of every variable) and the
   program of its initial values, none of which runs.
2. Every parameter gets its sharding from `tfx.parallel` (its logical axes and the rules) on a
   mesh (`mesh=`, or the one `jax.set_mesh` set), or the default device without one
   (`tfx.hf.placement`).
3. The plan's steps run one at a time, largest tensors first (so that the one-tensor overhead
   comes when little else is held), each step's tensors mapped from the files
   (`tfx.hf.io.Checkpoint`) by a thread while the step before is being done. A plain copy
   (`tfx.hf.plan.copy`) is transposed and cast by the placement, on the host for CPU devices
   and on the devices otherwise; any other step converts with numpy. Stacked layers
   (`scan_layers`) are filled row by row, one parameter kind after another.
4. Parameters that no step gives (strict=False's missing tensors, a family's OPTIONAL_PARAMS)
   and variables that are not parameters take their initial values: only the part of the
   traced program that computes them runs, op by op as `create` itself would, so they equal
   `create(config)`'s.

Host memory: what the parameters take and the step in flight. On CPU the parameters are the
page-aligned host arrays they were assembled in, which jax adopts without a copy.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import jax
import jax.extend.core as jaxpr_core
import numpy as np
from flax import nnx

from tfx.hf import io, placement, plan
from tfx.models import presets
from tfx.nn.paths import path_name
from tfx.parallel import resolve_mesh

__all__ = ["load_model", "resolve_mesh"]

Path = tuple[str | int, ...]
_FEW = 5  # names quoted in a message


def load_model(config, steps: Sequence[plan.Step], checkpoint: io.Checkpoint, *,
               left_out: Sequence[Path], optional: Sequence[Path], mesh, source: str):
    """The model `config` describes with the parameters the `steps` make from `checkpoint`.

    Args:
      config: a tfx model config (what `create` takes).
      steps: the checked plan (`tfx.hf.plan.check`): every parameter of the model comes from
        one step, except `left_out` ones and those under an `optional` path prefix, which keep
        their initial values.
      mesh: a jax Mesh to shard the parameters over, or None for the default device.
      source: the checkpoint's name in messages.
    Returns:
      the concrete nnx module (not yet in eval mode).
    Raises:
      ValueError: naming the parameters, before any tensor is read: steps that leave a
        parameter without a value, or give one the model lacks; a tensor of the wrong shape.
    """
    graphdef, variables, program = _trace(config)
    params = placement.placement(
        {path: var for path, var in variables if isinstance(var, nnx.Param)}, mesh)
    initial = _initial_units(params, steps, left_out, optional, source)
    for step in steps:
        if step.transpose is not None:
            params.check_shape(step.targets[0], _copied_shape(step, checkpoint), source)
    _run_all(sorted(steps, key=lambda step: _order(step, checkpoint, params)), checkpoint,
             params, source)
    rest = [path for path, var in variables if path not in params.abstract]
    wanted = {path for path, _ in initial} | set(rest)
    indices = [i for i, (path, _) in enumerate(variables) if path in wanted]
    computed = dict(zip((variables[i][0] for i in indices), _evaluate(program, indices),
                        strict=True))
    for path, row in initial:
        params.put(path, row, computed[path] if row is None else computed[path][row], False)
    values = params.values | {path: jax.device_put(computed[path], params.replicated())
                              for path in rest}
    state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in variables])
    return nnx.merge(graphdef, state)


def _run_all(steps: Sequence[plan.Step], checkpoint: io.Checkpoint,
             params: placement.Placement, source: str) -> None:
    """Do the steps in order. A reader thread maps each step's tensors, and has the placement
    get ready for it (on CPU: allocate the memory it fills), while the step before is done:
    reading, allocating and copying all let other threads run."""
    def read(step: plan.Step) -> list[np.ndarray]:
        params.prepare(step.targets)
        return [checkpoint[name] for name in step.sources]

    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        ahead = reader.submit(read, steps[0]) if steps else None
        for i, step in enumerate(steps):
            tensors = ahead.result()
            ahead = reader.submit(read, steps[i + 1]) if i + 1 < len(steps) else None
            _run(step, tensors, params, source)
            del tensors  # freed (or adopted by jax) before the next step's arrive


def _run(step: plan.Step, tensors: list[np.ndarray], params: placement.Placement,
         source: str) -> None:
    """Do one step on its source tensors: its values go to their parameters."""
    if step.transpose is not None:  # a plain copy: placement transposes and casts
        path, row = params.unit(step.targets[0])
        params.put(path, row, tensors[0], step.transpose)
        return
    values = step.convert(*tensors)
    for target, value in zip(step.targets, values, strict=True):
        params.check_shape(target, np.shape(value), source)
        params.put(*params.unit(target), value, False)


def _copied_shape(step: plan.Step, checkpoint: io.Checkpoint) -> tuple[int, ...]:
    shape = checkpoint.entries[step.sources[0]].shape
    return shape[::-1] if step.transpose else shape


def _initial_units(params: placement.Placement, steps: Sequence[plan.Step],
                   left_out: Sequence[Path], optional: Sequence[Path], source: str) -> list:
    """The parameters (rows) that keep their initial values; ValueError naming them when the
    steps leave others without a value or fill parameters the model lacks."""
    expected = {(path, row) for path, var in params.abstract.items()
                for row in (range(var.shape[0]) if io.is_stacked(path) else [None])}
    given = [params.unit(target) for step in steps for target in step.targets]
    unexpected = [unit for unit in given if unit not in expected]
    kept = {params.unit(path) for path in left_out} | {
        unit for unit in expected
        if any(io.layer_path(*unit)[:len(prefix)] == prefix for prefix in optional)}
    missing = expected - set(given) - kept
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the model: missing "
                         f"{_names(missing)}, unexpected {_names(unexpected)}")
    return sorted((kept & expected) - set(given), key=str)


def _names(units) -> list[str]:
    return sorted(path_name(io.layer_path(*unit)) for unit in units)[:_FEW]


def _order(step: plan.Step, checkpoint: io.Checkpoint, params: placement.Placement) -> tuple:
    """Sort key of a step: largest first; the rows of one stacked parameter together."""
    size = sum(checkpoint.entries[name].nbytes for name in step.sources)
    path, row = params.unit(step.targets[0]) if step.targets else ((), None)
    return -size, path_name(path), row or 0


def _trace(config):
    """(graph definition, [(path, abstract variable)], the closed jaxpr whose outputs are
    the variables' initial values in that order) of `create(config)`, traced only."""
    built = {}

    def build():
        # `presets.build`, not `create`: op by op, also under an enclosing jax.set_mesh (whose
        # `create` would make the variables in one compiled program).
        built["graphdef"], state = nnx.split(presets.build(config, _tracing_rngs(0)))
        return nnx.to_flat_state(state)

    program, variables = jax.make_jaxpr(build, return_shape=True)()
    variables = list(variables)
    assert len(variables) == len(program.jaxpr.outvars)  # one array per variable
    return built["graphdef"], variables, program


def _evaluate(program, indices: list[int]) -> list[jax.Array]:
    """Outputs `indices` of a closed jaxpr, running only the equations they
    depend on, one by one as eager code would (so the values are those eager `create` gives,
    to the bit)."""
    jaxpr = program.jaxpr
    outputs = [jaxpr.outvars[i] for i in indices]
    live = {var for var in outputs if isinstance(var, jaxpr_core.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if not live.isdisjoint(eqn.outvars):
            kept.append(eqn)
            live.update(var for var in eqn.invars if isinstance(var, jaxpr_core.Var))
    pruned = jaxpr.replace(eqns=kept[::-1], outvars=outputs,
                           debug_info=jaxpr.debug_info.with_unknown_names())
    return jax.core.eval_jaxpr(pruned, program.consts)


class _HostCount(nnx.RngCount):
    """An RNG stream's counter held as a numpy scalar while a model is traced: flax would
    otherwise look up a sharding on every traced counter update, which jax answers by walking
    the whole trace so far (tracing a model of L layers costs O(L^2)). The keys are the same:
    fold_in sees the same uint32 counts."""

    def __getitem__(self, index):
        value = self.get_value()  # traced inside nnx.vmap (scan_layers' split streams)
        return np.uint32(value) if isinstance(value, np.generic) else super().__getitem__(index)

    def __setitem__(self, index, value):
        if isinstance(value, np.generic | int):
            self.set_value(np.uint32(value))
        else:
            super().__setitem__(index, value)


def _tracing_rngs(seed: int) -> nnx.Rngs:
    """nnx.Rngs(seed) whose streams count with `_HostCount` (layers' own streams, forked or
    split from these, are ordinary)."""
    rngs = nnx.Rngs(seed)
    for _, stream in nnx.iter_graph(rngs):
        if isinstance(stream, nnx.RngStream):
            stream.count = _HostCount(np.uint32(0), tag=stream.tag)
    return rngs
