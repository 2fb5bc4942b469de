"""The configs' `Literal` choices (tfx.models.parts, tfx.models.config) are the keys of the
tables in tfx/nn and tfx/ops that give them their behaviour: the configs import without jax, the
tables with it, and these tests keep the two the same."""

from __future__ import annotations

from typing import get_args

import pytest

from tfx.models import config, parts
from tfx.nn.norms import NORMS, QK_NORMS
from tfx.nn.remat import POLICIES as REMAT_POLICIES
from tfx.ops import attention, moe
from tfx.ops.activations import ACTIVATIONS
from tfx.ops.positional.rope import LAYOUTS


@pytest.mark.parametrize("literal,table", [
    (parts.Activation, ACTIVATIONS),
    (parts.NormKind, NORMS),
    (parts.RopeLayout, LAYOUTS),
    (parts.AttentionImplementation, attention.IMPLEMENTATIONS),
    (parts.MoePolicy, moe.POLICIES),
    (parts.MoeDispatch, moe.IMPLEMENTATIONS),
    (parts.QKNorm, QK_NORMS),
    (parts.RematPolicy, REMAT_POLICIES),
], ids=lambda x: getattr(x, "__name__", None) if not isinstance(x, (tuple, dict)) else None)
def test_each_literal_lists_its_tables_keys(literal, table):
    assert set(get_args(literal)) == set(table)
    assert len(get_args(literal)) == len(table)


def test_positions_and_dtypes():
    assert get_args(config.Position) == config.POSITIONS
    assert parts.COMPUTE_DTYPES == (None, "float32", "bfloat16", "float16")
