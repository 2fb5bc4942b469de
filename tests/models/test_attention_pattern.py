"""DecoderConfig.attention_pattern: a decoder with a sparse pattern equals the same weights run
with the explicit dense mask `pattern & causal`, on both attention kernels, with and without
scanned layers; the config rejects bad patterns, and cached decoding refuses a pattern."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.generation import generate
from tfx.models import Decoder, DecoderConfig
from tfx.ops.sparse import parse_spec

SEQ = 48
PATTERNS = ("causal", "window:5", "strided:4", "fixed:8,2", "global:3", "random:8,2,1",
            "window:4|global:2|random:8,2")


def _config(**overrides):
    return DecoderConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                         attention={"num_kv_heads": 2}, d_ff=48, max_len=64,
                         position="rope").replace(**overrides)


def _ids(batch=2, seq=SEQ):
    return jax.random.randint(jax.random.key(1), (batch, seq), 0, 40)


def _explicit_mask_logits(model, ids, mask):
    """The model's logits with `mask` (bool, broadcastable to [batch, heads, seq, seq]) given to
    every layer as a plain boolean mask, and no pattern: the reference a pattern must match."""
    graphdef, state = nnx.split(model)
    dense = nnx.merge(graphdef, state)
    dense.stack.attention_pattern = None
    positions = jnp.arange(ids.shape[1])
    hidden = dense.stack(dense.embeddings(ids, positions), positions=positions,
                         mask=jnp.asarray(mask))
    return dense.logits(hidden)


def _reference_mask(text, seq=SEQ):
    """pattern & causal [1, 1, seq, seq], the causal part written out from the positions."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return (parse_spec(text).dense(seq, seq) & (j <= i))[None, None]


@pytest.mark.parametrize("implementation", ["reference", "blocked"])
@pytest.mark.parametrize("text", PATTERNS)
def test_pattern_equals_the_explicit_dense_mask(text, implementation):
    model = Decoder(_config(attention={"pattern": text, "implementation": implementation}),
                    rngs=nnx.Rngs(0))
    ids = _ids()
    got = nnx.jit(lambda m, x: m(x))(model, ids)
    want = _explicit_mask_logits(model, ids, _reference_mask(text))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_a_sparse_pattern_changes_the_output():
    """Guards the test above: a pattern that the stack ignored would still pass it for
    "causal", but not for a real pattern, which must differ from dense causal attention."""
    ids = _ids()
    dense = Decoder(_config(), rngs=nnx.Rngs(0))(ids)
    sparse = Decoder(_config(attention={"pattern": "window:4|global:2"}), rngs=nnx.Rngs(0))(ids)
    np.testing.assert_allclose(dense[:, :4], sparse[:, :4], atol=1e-5)  # inside the window
    assert np.abs(np.asarray(dense[:, 8:] - sparse[:, 8:])).max() > 1e-3


def test_scanned_layers_take_the_pattern_too():
    text = "strided:3|global:1"
    config = _config(attention={"pattern": text}, compute={"scan_layers": True})
    model = Decoder(config, rngs=nnx.Rngs(0))
    ids = _ids()
    want = _explicit_mask_logits(model, ids, _reference_mask(text))
    np.testing.assert_allclose(model(ids), want, atol=2e-5, rtol=2e-5)


def test_pattern_works_with_padding():
    text = "window:6|global:2"
    model = Decoder(_config(attention={"pattern": text}), rngs=nnx.Rngs(0))
    valid = jnp.stack([jnp.ones(SEQ, bool), jnp.arange(SEQ) < SEQ - 5])  # [batch, seq]
    ids = _ids()
    want = _explicit_mask_logits(model, ids, _reference_mask(text) & valid[:, None, None])
    np.testing.assert_allclose(model(ids, attention_mask=valid), want, atol=2e-5, rtol=2e-5)


def test_cached_decoding_refuses_a_pattern():
    model = Decoder(_config(attention={"pattern": "window:4|global:2"}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_pattern cannot decode with a KV cache"):
        generate(model, _ids(seq=4), max_new_tokens=2, temperature=0.0)


def test_default_config_has_no_pattern_and_equals_plain_causal():
    assert _config().attention.pattern is None
    model = Decoder(_config(), rngs=nnx.Rngs(0))
    ids = _ids()
    np.testing.assert_allclose(model(ids), _explicit_mask_logits(model, ids, _reference_mask(
        "causal")), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(attention={"pattern": "window:0"}), ValueError,
     r"attention\.pattern: bad part 'window:0'"),
    (dict(attention={"pattern": "tile:4"}), ValueError,
     r"attention\.pattern: .*unknown name 'tile'"),
    (dict(attention={"pattern": "window:4|"}), ValueError, r"attention\.pattern: .*grammar"),
    (dict(attention={"pattern": 4}), TypeError, r"attention\.pattern must be a str"),
    (dict(attention={"pattern": "window:4", "sliding_window": 8}), ValueError,
     r"attention\.sliding_window \(8\) or attention\.pattern .* not both"),
])
def test_bad_patterns_are_rejected_by_the_config(overrides, error, match):
    with pytest.raises(error, match=match):
        _config(**overrides)


def test_replace_validates_the_pattern_again():
    config = _config(attention={"pattern": "strided:4"})
    with pytest.raises(ValueError, match=r"attention\.pattern"):
        config.replace(attention={"pattern": "strided:-1"})
