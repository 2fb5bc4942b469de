"""How a model runs (`ComputeConfig`): its dtypes, by name, and what a rematerialised layer keeps
for its backward pass."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from tfx.models.parts._checks import boolean, one_of

__all__ = ["COMPUTE_DTYPES", "REMAT_POLICIES", "ComputeConfig", "Dtype", "RematPolicy"]

# Floating-point dtypes by name; resolved to jnp dtypes where modules are built.
Dtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES = (None, *get_args(Dtype))
# What a rematerialised layer keeps from its forward pass for the backward pass; the rest is
# recomputed. jax's own policies (`jax.checkpoint_policies.<name>`), from the most recomputation
# to none, then tfx's, which keep the tensors that the layers tag with checkpoint names.
# tfx.nn.remat.POLICIES maps each name to its jax policy and says which tags it keeps.
REMAT_POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable",
                  "everything_saveable", "save_attention_outputs", "save_qkv_proj",
                  "save_qkv_and_attention_outputs")
RematPolicy = Literal[REMAT_POLICIES]  # the tuple above, as tyro and the CLI read it


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """How the model runs. Dtypes are names, resolved where the modules are built
    (`tfx.models.config.compute_dtype`)."""

    dtype: Dtype | None = None
    """Compute dtype; None for the platform's default (bfloat16 on GPU/TPU, float32 on CPU)."""
    param_dtype: Dtype = "float32"
    """Storage dtype of the parameters."""
    remat: bool = False
    """Rematerialise each layer in the backward pass (less memory, more compute)."""
    remat_policy: RematPolicy = "nothing_saveable"
    """What a rematerialised layer keeps for its backward pass (tfx.nn.remat): from
    "nothing_saveable" (all recomputed) to "everything_saveable" (none), or the tensors a
    "save_*" policy names. Needs remat."""
    scan_layers: bool = False
    """Stack the layers' weights [num_layers, ...] and run them in nnx.scan: one layer
    compiled instead of num_layers."""

    def __post_init__(self):
        one_of("compute.dtype", self.dtype, COMPUTE_DTYPES)
        one_of("compute.param_dtype", self.param_dtype, get_args(Dtype))
        boolean("compute.remat", self.remat)
        one_of("compute.remat_policy", self.remat_policy, REMAT_POLICIES)
        if not self.remat and self.remat_policy != "nothing_saveable":
            raise ValueError(f"compute.remat_policy={self.remat_policy!r} applies to "
                             "rematerialised layers only: set compute.remat=True too")
        boolean("compute.scan_layers", self.scan_layers)
