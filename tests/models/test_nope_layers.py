"""rope.nope_layers: the listed layers' self-attention encodes no positions (SmolLM3), the
others rotate; bad lists are refused by name. (Logits against transformers: tests/hf/
test_smollm3.py.)"""

from __future__ import annotations

import pytest
from flax import nnx

from tfx.models import create
from tfx.nn.positions import Position, Rotary


def test_listed_layers_have_no_positional_encoding():
    model = create("llama-tiny", num_layers=3, rope={"nope_layers": (1,)}, rngs=nnx.Rngs(0))
    kinds = [type(layer.attention.position) for layer in model.stack.layers]
    assert kinds == [Rotary, Position, Rotary]


@pytest.mark.parametrize("changes, error, match", [
    (dict(rope={"nope_layers": (4,)}), ValueError, r"rope\.nope_layers must be layer indices < "
                                                   r"num_layers \(4\)"),
    (dict(rope={"nope_layers": [1]}), TypeError, r"rope\.nope_layers must be a tuple"),
    (dict(rope={"nope_layers": (1,)}, compute={"scan_layers": True}), ValueError,
     r"scan_layers runs one kind of layer: rope\.nope_layers"),
])
def test_bad_nope_layers_are_refused(changes, error, match):
    with pytest.raises(error, match=match):
        create("llama-tiny", rngs=nnx.Rngs(0), **changes)
