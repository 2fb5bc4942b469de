"""Keep freed host memory for reuse, so repeated XLA:CPU programs do not fault their pages in anew.

Why: XLA:CPU gives each call of a compiled program its temporaries in one block (610 MB for the
4-layer `char-gpt` training step at batch 16 × 256), from glibc's `malloc`. glibc serves every
block above its mmap threshold (at most 32 MiB) with a fresh `mmap` and returns it with
`munmap` when the call ends, so every call touches new pages: about 150,000 page faults per
step of that model, 0.3–0.5 s of kernel time (18% of the step's CPU samples under `perf` on a
2-core machine). PyTorch does not pay this: its tensors are mostly below the threshold, and glibc
reuses them.

`keep_freed_memory()` tells glibc (through `mallopt`) to serve large blocks from its heap and
not to return freed memory to the system, so the second call of a program reuses the first
call's pages (the heap may still grow a few times over the first calls, until the blocks of
calls that overlap fit). The process keeps its peak heap until it exits; nothing else changes.
All threads then share glibc's one main arena, because a thread's own arena serves large blocks
with `mmap` whatever the settings; that is why it must run before JAX starts its threads. The
shared arena costs something too (`_int_malloc` took 3% of the samples above, against 0.5%),
far less than the faults: on one core the step went from 1.67 to 1.43 s.

The `tfx` command calls it first thing, and so do the training, decoding, MoE and attention
benchmarks. Elsewhere (a script, a notebook) call it before the first JAX computation:

>>> import tfx.train.host_memory
>>> tfx.train.host_memory.keep_freed_memory()  # True on Linux with glibc
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

__all__ = ["keep_freed_memory"]

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER = -1  # mallopt(3): a trim threshold of -1 disables trimming


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of unmapping it (see the module).

    Call it at the start of a process, before JAX runs anything: threads that have already
    allocated keep their own arenas, which still map and unmap large blocks. Calling it again
    does nothing.

    Returns:
      True when the settings were applied (Linux with glibc), False where they do not exist
      (macOS, Windows, musl), which changes nothing.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER))
    applied = [libc.mallopt(parameter, value) == 1 for parameter, value in settings]
    return all(applied)
