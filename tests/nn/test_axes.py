"""tfx.nn.axes: logical axis names carried as variable metadata, through nnx.Linear and the
nnx.vmap that stacks layers."""

import jax.numpy as jnp
import pytest
from flax import nnx

from tfx.nn import axes


def test_linear_carries_names_and_stacking_prepends_layers():
    def make(rngs):
        return nnx.Linear(4, 8, kernel_metadata=axes.metadata(axes.EMBED, axes.HEADS),
                          bias_metadata=axes.metadata(axes.HEADS), rngs=rngs)

    layer = make(nnx.Rngs(0))
    assert layer.kernel.get_metadata(axes.KEY) == ("embed", "heads")
    assert layer.bias.get_metadata(axes.KEY) == ("heads",)
    stacked = nnx.split_rngs(splits=3)(nnx.vmap(
        make, in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS}))
    layers = stacked(nnx.Rngs(0))
    assert layers.kernel.shape == (3, 4, 8)
    assert layers.kernel.get_metadata(axes.KEY) == ("layers", "embed", "heads")


def test_names_are_logical_not_placed_when_made():
    # Flax places a value with sharding names on the mesh when it is made, unless told not to:
    # logical names are no mesh axes, and with no mesh at all that would raise.
    param = nnx.Param(jnp.zeros((2, 3)), **axes.metadata(None, axes.MLP))
    assert param.get_metadata(axes.KEY) == (None, "mlp")


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="'model' is not a logical axis name"):
        axes.metadata(axes.EMBED, "model")
