"""Compiling as users' programs compile, for the tests about a compiled program's structure
(what XLA fuses, copies, updates in place, how much scratch it keeps).

tests/conftest.py makes the suite's compiles cheaper with XLA:CPU flags that change how XLA
emits a program but not the operations it computes. One of them,
`xla_cpu_use_fusion_emitters=false`, also changes the program's structure (XLA then expands a
scatter into a loop of dynamic-update-slices, for one), so these tests turn it back to XLA's
default for their compile alone.
"""

from __future__ import annotations

import jax

USERS_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


def compile_as_users_do(lowered: jax.stages.Lowered, **options) -> jax.stages.Compiled:
    """`lowered.compile()` with XLA's default emitters; `options`: more compiler options."""
    return lowered.compile(compiler_options={**USERS_OPTIONS, **options})
