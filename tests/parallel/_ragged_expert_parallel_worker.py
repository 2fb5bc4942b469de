"""Worker for test_ragged_expert_parallel.py (run as a script): the "ragged" exchange of
expert_parallel_moe on meshes of 8 CPU devices, against the same single-device references as
_expert_parallel_worker.py (some of its cases, rerun here), each outcome written to OUT.json.

    python _ragged_expert_parallel_worker.py OUT

XLA:CPU has no ragged-all-to-all, so this process fakes a GPU for the platform choice and
replaces `jax.lax.ragged_all_to_all` with `emulated_ragged_all_to_all`: the collective's
documented semantics written with `all_gather`. What is checked is tfx's side (counts, sizes,
offsets, the reordering by local expert, the way back), values and gradients; not XLA's kernel.
"""

import os

# Before jax starts: 8 CPU devices, beside the test session's XLA flags (tests/conftest.py:
# the cheapest compiles; the cases are tiny).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import sys

import _expert_parallel_worker as fixed_cases
import jax
import jax.numpy as jnp

from tfx.ops.moe import expert_parallel

CALLS = []  # one entry per traced ragged_all_to_all: proof that the ragged path ran


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all's documented semantics (one slice per device): device s sends
    operand[input_offsets[j] : + send_sizes[j]] to device j, which writes it at
    output_offsets[j] (s's value) of its output. recv_sizes must agree with the senders'."""
    assert axis_index_groups is None
    CALLS.append(axis_name)
    me = jax.lax.axis_index(axis_name)
    operands, starts, sizes, targets, received = (
        jax.lax.all_gather(a, axis_name)
        for a in (operand, input_offsets, send_sizes, output_offsets, recv_sizes))
    position = jnp.arange(output.shape[0])
    result = output
    for source in range(operands.shape[0]):
        start, size, target = starts[source, me], sizes[source, me], targets[source, me]
        inside = (position >= target) & (position < target + size)
        rows = jnp.take(operands[source], jnp.clip(position - target + start, 0,
                                                   operand.shape[0] - 1), axis=0)
        result = jnp.where(inside[:, None], rows, result)
    # The contract the real collective assumes: the receiver's recv_sizes match.
    result = jnp.where(jnp.all(received[me] == sizes[:, me]), result, jnp.nan)
    return result


# A subset of the fixed exchange's cases (time): both meshes, dropless and with a capacity,
# top-1 and top-2, and the module's way of calling it.
CASES = ("expert8-k2_gated_silu-dropless", "data2_expert4-k1_plain_gelu-capacity",
         "data2_expert4-k2_gated_silu-dropless", "jit_inside_set_mesh")

def _through_the_ragged_exchange(check):
    def checked():
        CALLS.clear()
        check()
        assert CALLS, "the ragged exchange did not run"
    return checked


if __name__ == "__main__":
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
    expert_parallel.current_platform = lambda: "gpu"  # picks exchange="ragged" by default
    fixed_cases.run_and_report(((name, _through_the_ragged_exchange(check))
                                for name, check in fixed_cases.cases() if name in CASES),
                               sys.argv[1])
