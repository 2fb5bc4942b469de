"""Rematerialisation policies by name, and the checkpoint names the layers tag tensors with.

A rematerialised layer (`jax.checkpoint`, `nnx.remat`) keeps what its policy saves from the
forward pass and recomputes the rest in the backward pass. The policy names are
`tfx.models.parts.REMAT_POLICIES` (jax-free, for the configs and the CLI); `POLICIES` here maps
each one to its jax policy, in this one place. The layers tag their tensors with
`jax.ad_checkpoint.checkpoint_name(x, NAME)` and one of the names here: an identity, changing no
numbers, that a policy of `jax.checkpoint_policies.save_only_these_names` can select.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["ATTENTION_OUT", "CHECKPOINT_NAMES", "KEY_PROJ", "MLP_OUT", "POLICIES", "QUERY_PROJ",
           "SAVED_NAMES", "VALUE_PROJ", "checkpoint_policy"]

# The tensors a layer tags, by what they are: the projected queries, keys and values
# [batch, seq, heads * head_dim] (tfx.nn.Attention; not LatentAttention's low-rank ones), and
# each branch's output [batch, seq, d_model] before its residual sum (tfx.models.Block). A policy
# keeps a named tensor only where the backward pass reads it: a plain residual sum does not
# read the MLP's output, an output norm (`norm.outputs`, Gemma) does.
QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"
ATTENTION_OUT, MLP_OUT = "attention_out", "mlp_out"
CHECKPOINT_NAMES = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT, MLP_OUT)

# The tagged policies: what each keeps. A kept projection spares its matmul in the backward
# pass; a kept attention output spares the residual sum and the norm after it.
SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "save_attention_outputs": (ATTENTION_OUT,),
    "save_qkv_proj": (QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
    "save_qkv_and_attention_outputs": (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT),
}
_jax = jax.checkpoint_policies
# Policy name -> the `policy` argument of jax.checkpoint / nnx.remat.
POLICIES: dict[str, Callable[..., bool]] = {
    "nothing_saveable": _jax.nothing_saveable,  # jax.checkpoint's default: keep the inputs
    "dots_with_no_batch_dims_saveable": _jax.dots_with_no_batch_dims_saveable,
    "dots_saveable": _jax.dots_saveable,
    "everything_saveable": _jax.everything_saveable,
    **{name: _jax.save_only_these_names(*saved) for name, saved in SAVED_NAMES.items()},
}


def checkpoint_policy(name: str) -> Callable[..., bool]:
    """The jax policy of a policy name (`tfx.models.parts.REMAT_POLICIES`)."""
    if name not in POLICIES:
        raise ValueError(f"remat_policy must be one of {tuple(POLICIES)}, got {name!r}")
    return POLICIES[name]
