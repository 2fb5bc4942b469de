"""The encoder parts ModernBERT brought, each a config field: bidirectional sliding windows
(attention.sliding_window / layer_types in an EncoderConfig), LayerNorms without bias
(norm.bias), normalised embeddings in a pre-norm model (embeddings.norm), no attention norm in
the first layer (norm.first_attention), no token types (type_vocab_size 0)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import Encoder, EncoderConfig

TINY = dict(vocab_size=50, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=32,
            position="rope")


def test_an_encoder_window_is_bidirectional():
    """With one layer of window 3, token 5 sees tokens 3..7 only: changing token 0 or 9 leaves
    it, and changing token 7 does not."""
    model = Encoder(EncoderConfig(**{**TINY, "num_layers": 1}, attention={"sliding_window": 3}),
                    rngs=nnx.Rngs(0))
    ids = jnp.arange(10)[None] + 1

    def at_5(changed: int) -> np.ndarray:
        return np.asarray(model(ids.at[0, changed].set(40))[0, 5])

    same = np.asarray(model(ids)[0, 5])
    np.testing.assert_allclose(at_5(0), same, atol=1e-6)
    np.testing.assert_allclose(at_5(9), same, atol=1e-6)
    assert np.abs(at_5(3) - same).max() > 1e-4 and np.abs(at_5(7) - same).max() > 1e-4


def test_layer_types_pick_each_layers_window():
    config = EncoderConfig(**TINY, attention={"sliding_window": 3,
                                              "layer_types": ("full", "sliding")})
    assert Encoder(config, rngs=nnx.Rngs(0)).stack.windows == (None, 3)


def test_modernbert_norm_parts():
    config = EncoderConfig(**TINY, type_vocab_size=0, norm={"bias": False,
                                                            "first_attention": False},
                           embeddings={"norm": True})
    model = Encoder(config, rngs=nnx.Rngs(0))
    layers = model.stack.layers
    assert layers[0].attention_norm is None and layers[1].attention_norm is not None
    assert model.embeddings.norm is not None and model.embeddings.token_types is None
    assert all(norm.bias is None for norm in (model.embeddings.norm, layers[1].attention_norm,
                                              model.stack.final_norm, model.mlm_norm))
    assert model(jnp.arange(6)[None]).shape == (1, 6, 16)


@pytest.mark.parametrize("changes, message", [
    (dict(norm={"first_attention": False, "pre_norm": False}), r"norm\.first_attention=False"),
    (dict(norm={"first_attention": False}, compute={"scan_layers": True}),
     r"norm\.first_attention=False makes the first one differ"),
    (dict(norm={"bias": 0}), r"norm\.bias must be a bool"),
    (dict(embeddings={"norm": "yes"}), r"embeddings\.norm must be a bool"),
    (dict(type_vocab_size=-1), r"type_vocab_size must be >= 0"),
])
def test_the_parts_are_validated_by_name(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EncoderConfig(**TINY, **changes)
