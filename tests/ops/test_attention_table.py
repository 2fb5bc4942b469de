"""The attention table is the dispatch: one record per kernel, named by its table line."""

from __future__ import annotations

import subprocess
import sys
import typing

from tfx.models.parts import AttentionImplementation
from tfx.ops.attention import IMPLEMENTATIONS, dispatch, table
from tfx.ops.attention.kernel import Kernel


def test_every_table_line_loads_its_record_under_its_name():
    assert tuple(dispatch.KERNELS) == tuple(table.KERNELS) == IMPLEMENTATIONS
    for name, record in dispatch.KERNELS.items():
        assert isinstance(record, Kernel) and record.name == name and callable(record.run)


def test_the_config_literal_is_the_table():
    assert typing.get_args(AttentionImplementation) == IMPLEMENTATIONS


def test_the_reference_kernel_ends_the_table_and_runs_everywhere():
    reference = dispatch.KERNELS[IMPLEMENTATIONS[-1]]
    assert reference.name == "reference" and reference.needs == () and reference.platforms is None


def test_the_names_import_without_jax():
    code = ("import sys; from tfx.ops.attention.table import IMPLEMENTATIONS; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
