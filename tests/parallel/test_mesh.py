"""tfx.parallel.mesh on this process's single CPU device (meshes of 8 devices are built by
_sharded_worker.py, see test_training.py)."""

import types

import jax
import pytest
from jax.sharding import AxisType

from tfx.parallel import AXES, make_mesh, mesh_from_config
from tfx.train.config import MeshConfig


def test_default_mesh_takes_every_device_on_the_data_axis():
    mesh = make_mesh()
    assert mesh.axis_names == AXES == ("data", "fsdp", "expert", "sequence", "tensor")
    assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "expert": 1,
                                "sequence": 1, "tensor": 1}
    # Auto axes: shardings of inputs and parameters propagate through unannotated model code.
    assert mesh.axis_types == (AxisType.Auto,) * 5


@pytest.mark.parametrize("axes", [dict(data=1, fsdp=-1), dict(data=1, tensor=-1),
                                  dict(data=1, expert=-1), dict(data=1, sequence=-1)])
def test_any_one_axis_may_take_the_remaining_devices(axes):
    mesh = make_mesh(**axes)
    free = next(name for name, size in axes.items() if size == -1)
    assert mesh.shape[free] == jax.device_count()


@pytest.mark.parametrize("axes, message", [
    (dict(data=2), r"data=2 \* fsdp=1 \* expert=1 \* sequence=1 \* tensor=1 = 2 must "
                   r"multiply to the device count 1"),
    (dict(tensor=2), r"data=-1 takes the devices left over, but 1 devices are not divisible "
                     r"by fsdp=1 \* expert=1 \* sequence=1 \* tensor=2 = 2"),
    (dict(data=-1, fsdp=-1), r"at most one mesh axis may be -1, got \['data', 'fsdp'\]"),
    (dict(fsdp=0), r"mesh axis fsdp must be an int >= 1 or -1, got 0"),
    (dict(tensor=1.0), r"mesh axis tensor must be an int >= 1 or -1, got 1.0"),
    (dict(expert=True), r"mesh axis expert must be an int >= 1 or -1, got True"),
])
def test_bad_sizes_raise_naming_the_axis(axes, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(**axes)


def test_explicit_devices():
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    assert list(mesh.devices.flat) == jax.devices()[:1]


def test_mesh_from_config_reads_expert_when_present():
    assert dict(mesh_from_config(MeshConfig()).shape)["data"] == jax.device_count()
    config = types.SimpleNamespace(data=1, fsdp=1, tensor=1, expert=2)
    with pytest.raises(ValueError, match="expert=2"):
        mesh_from_config(config)


def test_mesh_from_config_reads_sequence():
    config = types.SimpleNamespace(data=1, fsdp=1, tensor=1, expert=1, sequence=2)
    with pytest.raises(ValueError, match="sequence=2"):
        mesh_from_config(config)
