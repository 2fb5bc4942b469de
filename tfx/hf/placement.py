"""Where each loaded parameter goes and how it gets there (for `tfx.hf.streaming`).

Every parameter has a sharding: on a mesh, the one `tfx.parallel` gives it (its logical axes
mapped by the rules); without one, the default device. Its value arrives in pieces, host arrays
(a whole tensor, or one layer's row of a stacked `scan_layers` parameter), each maybe to be
transposed (torch's [out, in] to nnx's [in, out]) and cast to the parameter's dtype. How the
pieces are assembled depends on the devices' platform (`placement` picks):

- CPU devices (`HOST_PLATFORMS`): on the host. The parameter is assembled in page-aligned memory
  (`tfx.hf.tensorfiles.host_array`) that jax then adopts as the device array without copying:
  one pass over each tensor (`tfx.hf.tensorfiles.copy_into`: transposed in blocks of rows,
  cast by numpy), no compilation, and no memory beyond the parameters themselves.
- Accelerators: on the devices. A piece goes to the devices as it is read, laid out as its
  transpose needs (so that no data moves between devices), and small compiled programs
  transpose, cast, and write a row of a stacked parameter in place (the buffer is donated);
  the host holds one tensor at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from tfx.hf import io, tensorfiles
from tfx.nn.paths import path_name
from tfx.parallel import param_specs

__all__ = ["HOST_PLATFORMS", "Placement", "placement"]

Path = tuple[str | int, ...]
# Platforms whose devices hold arrays in the host's own memory.
HOST_PLATFORMS = ("cpu",)


def placement(abstract: dict[Path, nnx.Param], mesh) -> Placement:
    """The Placement of parameters `abstract` (path -> nnx Param holding a ShapeDtypeStruct,
    with its logical axes) on `mesh` (None: the default device), for the devices' platform."""
    devices = mesh.devices.flat if mesh is not None else [jax.local_devices()[0]]
    on_host = all(device.platform in HOST_PLATFORMS for device in devices)
    return (_OnHost if on_host else _OnDevice)(abstract, mesh)


class Placement:
    """The parameters as they are filled: their abstract values, shardings, and the values
    put so far (`values`, path -> jax Array in its sharding, once complete)."""

    def __init__(self, abstract: dict[Path, nnx.Param], mesh):
        self.abstract, self.mesh, self.values = abstract, mesh, {}
        self.device = None if mesh else SingleDeviceSharding(jax.local_devices()[0])
        self.specs = {}
        if mesh is not None:  # PartitionSpecs padded with None to one entry per dimension
            specs = dict(nnx.to_flat_state(
                param_specs(nnx.from_flat_state(list(abstract.items())), mesh)))
            self.specs = {path: (*specs[path].get_value(), *[None] * len(var.shape))[
                :len(var.shape)] for path, var in abstract.items()}

    def unit(self, target: Path) -> tuple[Path, int | None]:
        """The parameter (and row, for stacked layers) that a plan's target path fills."""
        return (target, None) if target in self.abstract else io.split_layer(target)

    def shape(self, path: Path, row: int | None) -> tuple[int, ...]:
        shape = tuple(self.abstract[path].shape)
        return shape if row is None else shape[1:]

    def sharding(self, path: Path, row: int | None = None, transpose: bool = False):
        """Where (a row of) a parameter goes; transposed: where its transpose goes."""
        if self.mesh is None:
            return self.device
        spec = list(self.specs[path][0 if row is None else 1:])
        spec = spec[::-1] if transpose else spec
        while spec and spec[-1] is None:  # the canonical form, as tfx.parallel writes specs
            spec.pop()
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def replicated(self):
        return self.device or NamedSharding(self.mesh, PartitionSpec())

    def check_shape(self, target: Path, shape: tuple[int, ...], source: str) -> None:
        expected = self.shape(*self.unit(target))
        if tuple(shape) != expected:
            raise ValueError(f"{source}: tensor for {path_name(target)} has shape "
                             f"{tuple(shape)}, the model expects {expected}")

    def prepare(self, targets: tuple[Path, ...]) -> None:
        """Get ready for `put`s to the plan's `targets`; called ahead, from another thread."""

    def put(self, path: Path, row: int | None, value, transpose: bool) -> None:
        """Set (row `row` of) parameter `path` to `value` (a numpy or jax array), transposed
        first when asked, cast to the parameter's dtype."""
        raise NotImplementedError


class _OnHost(Placement):
    """CPU devices: parameters assembled on the host, adopted by jax when complete."""

    def __init__(self, abstract: dict[Path, nnx.Param], mesh):
        super().__init__(abstract, mesh)
        self.staged, self.missing = {}, {}  # path -> host array; rows still to come

    def prepare(self, targets: tuple[Path, ...]) -> None:
        # The reader thread allocates the memory the next step fills (the kernel zeroes it
        # while this step copies). No lock: a parameter it finds unstaged is one no earlier
        # step touched, and `put` fills a parameter only after its step was prepared.
        for target in targets:
            path, row = self.unit(target)
            if path not in self.staged and path not in self.values:
                var = self.abstract[path]
                self.missing[path] = 1 if row is None else var.shape[0]
                self.staged[path] = tensorfiles.host_array(var.shape, var.dtype)

    def put(self, path: Path, row: int | None, value, transpose: bool) -> None:
        self.prepare((io.layer_path(path, row),))  # values that no step gave come unprepared
        staged = self.staged[path]
        value = np.asarray(value)
        tensorfiles.copy_into(staged if row is None else staged[row],
                              value.T if transpose else value)
        self.missing[path] -= 1
        if not self.missing[path]:  # complete: jax adopts the memory (one CPU device)
            self.values[path] = jax.device_put(self.staged.pop(path), self.sharding(path))


class _OnDevice(Placement):
    """Accelerators: pieces placed as they come, converted and stacked on the devices."""

    def put(self, path: Path, row: int | None, value, transpose: bool) -> None:
        value = jax.device_put(value, self.sharding(path, row, transpose))
        dtype, sharding = self.abstract[path].dtype, self.sharding(path)
        if row is None:
            needs_work = transpose or value.dtype != dtype
            self.values[path] = _converter(transpose, dtype, sharding)(value) if needs_work \
                else value
            return
        if path not in self.values:
            self.values[path] = jnp.zeros(self.abstract[path].shape, dtype, device=sharding)
        self.values[path] = _row_setter(transpose, sharding)(self.values[path], value, row)


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
