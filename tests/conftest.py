"""Test-session settings shared by every test file.

JAX's persistent compilation cache, in `build/jax-cache` (git-ignored): the suite compiles the
same small programs again and again, in both pytest-xdist workers and in the `tfx train` /
`tfx sample` subprocesses of the command-line tests, and a cached program loads in milliseconds
(a repeated tiny `tfx train` takes half the time). The cache is keyed on the program, the jax
version and the flags, so it never changes a result. Set in the environment, so subprocesses
inherit it; a `JAX_COMPILATION_CACHE_DIR` already set by the caller wins.

When a worker holds many compiled programs, they are dropped at the end of a test file. XLA:CPU
maps a few memory regions per executable and JAX keeps every executable its jitted functions
compiled, so a worker running half the suite reached Linux's limit of 65,530 mappings
(vm.max_map_count) and died inside XLA (a segfault while compiling, an abort while serializing
to the cache): 21,000 mappings after the first nine files of one worker. Dropping them after
every file would recompile what later files share, so only past 30,000.
"""

from __future__ import annotations

import os
import pathlib

import pytest

_CACHE = pathlib.Path(__file__).resolve().parents[1] / "build" / "jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
# Cache every program that took a tenth of a second or more to compile (the default is 1 s,
# which on a busy 2-core machine leaves out most of the suite's small programs).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# The suite's programs are small, so compiling them costs more than running them; two XLA:CPU
# flags make compiling cheaper, and neither changes the operations a program computes nor turns
# on fast-math:
# - LLVM's optimisation level 0 for the generated code: a level-0 compile is 20-30% faster
#   (tests/train/test_step.py 132 s -> 100 s);
# - loop fusions emitted by XLA's elemental LLVM emitters instead of its MLIR fusion emitters:
#   a third less compile time (tests/models/test_functional.py 47 s -> 30 s; the same logits
#   and gradients bit for bit on llama-tiny and char-gpt). Both flags exist from jaxlib 0.8.1
#   (the lowest version pyproject.toml allows); XLA aborts on a flag it does not know.
# Appended, so flags the caller sets stay.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


_MAPS = pathlib.Path("/proc/self/maps")
MAX_MAPPINGS = 30_000  # of Linux's default vm.max_map_count, 65,530


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Release the worker's executables (and their memory mappings) after a test file that
    leaves more than MAX_MAPPINGS mappings."""
    yield
    if _MAPS.exists() and _MAPS.read_text().count("\n") > MAX_MAPPINGS:
        import jax  # here, not at the top: jax reads the cache settings above when imported

        jax.clear_caches()
