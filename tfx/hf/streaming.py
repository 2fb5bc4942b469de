"""Loading a checkpoint into a model that is never initialised at random, tensor by tensor,
straight onto the devices (what `tfx.hf.load` does after checking the files' headers).

1. The model is traced, not built: `jax.make_jaxpr` of `create(config)` gives its structure
   (the nnx graph definition; the shape, dtype and logical axes of every variable) and the
   program of its initial values, none of which runs.
2. Every parameter gets its sharding from `tfx.parallel` (its logical axes and the rules) on a
   mesh (`mesh=`, or the one `jax.set_mesh` set), or the default device without one.
3. The plan's steps run one at a time, largest tensors first (so that the one-tensor overhead
   comes when little else is held): each source is read into memory of its own
   (`tfx.hf.io.Checkpoint`) and put on its devices; a plain copy (`tfx.hf.plan.copy`) is
   transposed and cast there (XLA transposes many times faster than numpy), any other step
   converts on the host. Stacked layers (`scan_layers`) start as zeros and get their rows one
   by one, written in place (the buffer is donated).
4. Parameters that no step gives (strict=False's missing tensors, a family's OPTIONAL_PARAMS)
   and variables that are not parameters take their initial values: only the part of the
   traced program that computes them runs, op by op as `create` itself would, so they equal
   `create(config)`'s.

Host memory: the tensor in flight and what the devices hold, no more: on CPU, jax adopts a
tensor read into page-aligned memory (`tensorfiles.host_array`) as a parameter without copying it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.extend.core as jaxpr_core
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from tfx.hf import io, plan, tensorfiles
from tfx.models import create
from tfx.nn.paths import path_name
from tfx.parallel import param_specs

__all__ = ["load_model", "resolve_mesh"]

Path = tuple[str | int, ...]
Unit = tuple[Path, int | None]  # a parameter, or row i of a stacked one
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
    params = _Params({path: var for path, var in variables if isinstance(var, nnx.Param)},
                     mesh)
    initial = params.initial_units(steps, left_out, optional, source)
    for step in steps:
        if step.transpose is not None:
            params.check_shape(step.targets[0], _copied_shape(step, checkpoint), source)
    for step in sorted(steps, key=lambda step: params.order(step, checkpoint)):
        _run(step, checkpoint, params, source)
    rest = [path for path, var in variables if path not in params.abstract]
    wanted = {path for path, _ in initial} | set(rest)
    indices = [i for i, (path, _) in enumerate(variables) if path in wanted]
    computed = dict(zip((variables[i][0] for i in indices), _evaluate(program, indices),
                        strict=True))
    for path, row in initial:
        value = computed[path] if row is None else computed[path][row]
        params.put(path, row, jax.device_put(value, params.sharding(path, row)), False)
    values = params.values | {path: jax.device_put(computed[path], params.replicated())
                              for path in rest}
    state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in variables])
    return nnx.merge(graphdef, state)


def resolve_mesh(mesh):
    """`mesh` (a jax Mesh), else the mesh `jax.set_mesh` set, else None (no mesh)."""
    if mesh is None:
        mesh = jax.sharding.get_mesh()  # an empty Mesh outside jax.set_mesh
        return None if mesh.empty else mesh
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. tfx.parallel.make_mesh(...)) "
                        f"or None, got {type(mesh).__name__}")
    return mesh


def _run(step: plan.Step, checkpoint: io.Checkpoint, params: _Params, source: str) -> None:
    """Do one step: its values go to their parameters on the devices."""
    if step.transpose is not None:  # a plain copy: transposed and cast on the device
        path, row = params.unit(step.targets[0])
        tensor = checkpoint[step.sources[0]]
        params.put(path, row, jax.device_put(tensor, params.sharding(path, row, step.transpose)),
                   step.transpose)
        return
    values = step.convert(*(checkpoint[name] for name in step.sources))
    for target, value in zip(step.targets, values, strict=True):
        params.check_shape(target, np.shape(value), source)
        path, row = params.unit(target)
        staged = tensorfiles.host_array(np.shape(value), params.abstract[path].dtype)
        np.copyto(staged, value, casting="unsafe")  # into the parameter's dtype, aligned
        params.put(path, row, jax.device_put(staged, params.sharding(path, row)), False)


def _copied_shape(step: plan.Step, checkpoint: io.Checkpoint) -> tuple[int, ...]:
    shape = checkpoint.entries[step.sources[0]].shape
    return shape[::-1] if step.transpose else shape


class _Params:
    """The model's parameters as they are filled: abstract ones (nnx Params holding
    ShapeDtypeStructs, with their logical axes) by path, their shardings, and the values put
    so far, each on its devices."""

    def __init__(self, abstract: dict[Path, nnx.Param], mesh):
        self.abstract, self.mesh, self.values = abstract, mesh, {}
        self.device = None if mesh else SingleDeviceSharding(jax.local_devices()[0])
        self.specs = {}
        if mesh is not None:  # PartitionSpecs padded with None to one entry per dimension
            specs = dict(nnx.to_flat_state(
                param_specs(nnx.from_flat_state(list(abstract.items())), mesh)))
            self.specs = {path: (*specs[path].get_value(), *[None] * len(var.shape))[
                :len(var.shape)] for path, var in abstract.items()}

    def unit(self, target: Path) -> Unit:
        """The parameter (and row, for stacked layers) that a plan's target path fills."""
        return (target, None) if target in self.abstract else io.split_layer(target)

    def shape(self, path: Path, row: int | None) -> tuple[int, ...]:
        shape = tuple(self.abstract[path].shape)
        return shape if row is None else shape[1:]

    def sharding(self, path: Path, row: int | None = None, transpose: bool = False):
        """Where (a row of) a parameter goes; transposed: where its transpose goes, so that
        transposing it on the devices moves no data between them."""
        if self.mesh is None:
            return self.device
        spec = list(self.specs[path][0 if row is None else 1:])
        spec = spec[::-1] if transpose else spec
        while spec and spec[-1] is None:  # the canonical form, as tfx.parallel writes specs
            spec.pop()
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def replicated(self):
        return self.device or NamedSharding(self.mesh, PartitionSpec())

    def put(self, path: Path, row: int | None, value: jax.Array, transpose: bool) -> None:
        """Set (row `row` of) parameter `path` to `value`, transposed first if asked, cast to
        the parameter's dtype, in the parameter's sharding."""
        dtype, sharding = self.abstract[path].dtype, self.sharding(path)
        if row is None:
            needs_work = transpose or value.dtype != dtype
            self.values[path] = _converter(transpose, dtype, sharding)(value) if needs_work \
                else value
            return
        if path not in self.values:
            self.values[path] = jnp.zeros(self.abstract[path].shape, dtype, device=sharding)
        self.values[path] = _row_setter(transpose, sharding)(self.values[path], value, row)

    def check_shape(self, target: Path, shape: tuple[int, ...], source: str) -> None:
        expected = self.shape(*self.unit(target))
        if tuple(shape) != expected:
            raise ValueError(f"{source}: tensor for {path_name(target)} has shape "
                             f"{tuple(shape)}, the model expects {expected}")

    def order(self, step: plan.Step, checkpoint: io.Checkpoint) -> tuple:
        """Sort key of a step: largest first; rows of one stacked parameter together."""
        size = sum(checkpoint.entries[name].nbytes for name in step.sources)
        path, row = self.unit(step.targets[0]) if step.targets else ((), None)
        return -size, path_name(path), row or 0

    def initial_units(self, steps: Sequence[plan.Step], left_out: Sequence[Path],
                      optional: Sequence[Path], source: str) -> list[Unit]:
        """The parameters (rows) that keep their initial values; ValueError naming them when
        the steps leave others without a value or fill parameters the model lacks."""
        expected = {(path, row) for path, var in self.abstract.items()
                    for row in (range(var.shape[0]) if io.is_stacked(path) else [None])}
        given = [self.unit(target) for step in steps for target in step.targets]
        unexpected = [unit for unit in given if unit not in expected]
        kept = {self.unit(path) for path in left_out} | {
            unit for unit in expected
            if any(io.layer_path(*unit)[:len(prefix)] == prefix for prefix in optional)}
        missing = expected - set(given) - kept
        if missing or unexpected:
            raise ValueError(f"{source}: weights do not match the model: missing "
                             f"{_names(missing)}, unexpected {_names(unexpected)}")
        return sorted((kept & expected) - set(given), key=str)


def _names(units) -> list[str]:
    return sorted(path_name(io.layer_path(*unit)) for unit in units)[:_FEW]


@functools.cache
def _converter(transpose: bool, dtype, sharding):
    """A compiled `x -> x.T (or x) as dtype`, laid out in `sharding`."""
    return jax.jit(lambda x: (x.T if transpose else x).astype(dtype), out_shardings=sharding)


@functools.cache
def _row_setter(transpose: bool, sharding):
    """A compiled `(stacked, x, i) -> stacked with row i = x.T (or x)`, writing in place: the
    stacked buffer is donated, so no second copy of it is ever made."""
    def set_row(stacked, value, row):
        value = (value.T if transpose else value).astype(stacked.dtype)
        return jax.lax.dynamic_update_index_in_dim(stacked, value, row, 0)

    return jax.jit(set_row, out_shardings=sharding, donate_argnums=0)


def _trace(config):
    """(graph definition, [(path, abstract variable)], the closed jaxpr whose outputs are
    the variables' initial values in that order) of `create(config)`, traced only."""
    built = {}

    def build():
        built["graphdef"], state = nnx.split(create(config, rngs=_tracing_rngs(0)))
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
