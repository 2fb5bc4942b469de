"""tfx.ops.positional.ProportionalScaling: transformers' "proportional" rope
(`_compute_proportional_rope_parameters`), written out in numpy: over the whole head d, pairs
(i, i + d/2); the first int(fraction · d // 2) pairs turn by p · theta^(-2i/d) / factor, the
others stay."""

import numpy as np
import pytest

from tfx.ops.positional import ProportionalScaling, apply_rope


def _reference(x, positions, theta, fraction, factor):
    d = x.shape[-1]
    turned = int(fraction * d // 2)
    inv = np.zeros(d // 2)
    inv[:turned] = 1.0 / theta ** (np.arange(0, 2 * turned, 2) / d)
    angles = positions[:, None] * inv / factor  # [seq, d/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    first, second = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


@pytest.mark.parametrize("fraction, factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_matches_the_written_out_formula(fraction, factor):
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 16)).astype(np.float32)
    positions = np.arange(5) * 7
    ours = apply_rope(x, positions, theta=100.0,
                      scaling=ProportionalScaling(fraction, factor))
    np.testing.assert_allclose(ours, _reference(x, positions, 100.0, fraction, factor),
                               rtol=1e-5, atol=1e-5)


def test_unturned_pairs_are_left_as_they_are():
    x = np.random.default_rng(1).normal(size=(1, 4, 1, 16)).astype(np.float32)
    out = np.asarray(apply_rope(x, np.arange(4) + 3, theta=10.0,
                                scaling=ProportionalScaling(0.25)))
    kept = [i for i in range(16) if i % 8 >= 2]  # pairs 2..7 of each half
    np.testing.assert_array_equal(out[..., kept], x[..., kept])
    assert not np.allclose(out[..., :2], x[..., :2])


@pytest.mark.parametrize("fields, match", [
    (dict(fraction=0.0), "fraction"), (dict(fraction=1.5), "fraction"),
    (dict(fraction=0.5, factor=-1.0), "factor"), (dict(fraction=True), "fraction"),
])
def test_bad_fields_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        ProportionalScaling(**fields)
