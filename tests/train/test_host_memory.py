"""tfx.train.host_memory: after keep_freed_memory(), calls of a compiled program with a large
temporary reuse the previous call's pages instead of faulting fresh ones in."""

import json
import platform
import subprocess
import sys

import pytest

# A program whose temporaries (64 MiB products) are far above glibc's largest mmap threshold.
# The heap still grows a few times while it settles (a call can start before the previous call's
# block is freed; on a loaded machine six times in the first eighty calls), so the test counts
# sixty calls and allows a quarter of their blocks.
CHILD = """
import json, resource, sys
if sys.argv[1] == "keep":
    from tfx.train.host_memory import keep_freed_memory
    assert keep_freed_memory()
import jax, jax.numpy as jnp
program = jax.jit(lambda a, b: jnp.sin(a @ b) @ b.T)
a, b = jnp.ones((4096, 8)), jnp.ones((8, 4096))
for _ in range(2):
    program(a, b).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(60):
    program(a, b).block_until_ready()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""
PAGES = 60 * 64 * 2**20 // 4096  # a 64 MiB temporary in each of sixty calls, in 4 KiB pages


def _child(script: str, *args: str) -> str:
    """What `python -c script args...` prints: the setting stays in that process."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          check=True, timeout=120).stdout


def _page_faults(mode: str) -> int:
    return json.loads(_child(CHILD, mode).splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_repeated_calls_reuse_their_temporary_pages():
    unchanged = _page_faults("default")
    if unchanged < PAGES // 2:
        pytest.skip(f"this machine's malloc does not fault large blocks in anew ({unchanged} "
                    f"faults in sixty calls)")
    assert _page_faults("keep") < PAGES // 4, unchanged


def test_it_applies_once_and_says_whether_it_did():
    printed = _child("from tfx.train.host_memory import keep_freed_memory as k; print(k(), k())")
    applied = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert printed.split() == [str(applied)] * 2
