"""Test-session settings shared by every test file.

JAX's persistent compilation cache, in `build/jax-cache` (git-ignored): the suite compiles the
same small programs again and again, in both pytest-xdist workers and in the `tfx train` /
`tfx sample` subprocesses of the command-line tests, and a cached program loads in milliseconds
(a repeated tiny `tfx train` takes half the time). The cache is keyed on the program, the jax
version and the flags, so it never changes a result. Set in the environment, so subprocesses
inherit it; a `JAX_COMPILATION_CACHE_DIR` already set by the caller wins.
"""

from __future__ import annotations

import os
import pathlib

_CACHE = pathlib.Path(__file__).resolve().parents[1] / "build" / "jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
# Cache every program that took a tenth of a second or more to compile (the default is 1 s,
# which on a busy 2-core machine leaves out most of the suite's small programs).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
