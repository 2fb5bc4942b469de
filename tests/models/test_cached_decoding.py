"""Cached decoding equals the uncached full-sequence model at every step, for every positional
encoding, sliding windows (ring buffer, decoding past the window), scanned layers, padding on
either side, and encoder–decoder cross-attention."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import Decoder, DecoderConfig, EncoderDecoder, EncoderDecoderConfig

SEQ, PREFILL = 12, 5
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "t5", "none")


def _decoder(**overrides):
    config = DecoderConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                           attention={"num_kv_heads": 2}, d_ff=48, max_len=32).replace(**overrides)
    return Decoder(config, rngs=nnx.Rngs(0))


def _ids(batch=2, seq=SEQ, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 40)


@nnx.jit
def _step(model, ids, mask, cache):
    return model(ids, attention_mask=mask, cache=cache)


@nnx.jit
def _decode_step(model, ids, cache):
    return model.decode(ids, cache=cache)


def _cached_logits(model, ids, mask=None, prefill=PREFILL, max_len=20):
    """Prefill `prefill` tokens in one call, then one token per call; logits [batch, seq, vocab]."""
    cache = model.init_cache(ids.shape[0], max_len)
    chunks = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    outs = []
    for start, stop in chunks:
        chunk_mask = None if mask is None else mask[:, start:stop]
        logits, cache = _step(model, ids[:, start:stop], chunk_mask, cache)
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), cache


CASES = [(p, w, False) for p in POSITIONS for w in (None, 4)] + [("rope", 4, True),
                                                                  ("t5", None, True)]


@pytest.mark.parametrize(("position", "window", "scan"), CASES)
def test_cached_logits_equal_full_sequence(position, window, scan):
    model = _decoder(position=position, attention={"sliding_window": window},
                     compute={"scan_layers": scan})
    ids = _ids()
    got, cache = _cached_logits(model, ids)
    chex.assert_trees_all_close(got, nnx.jit(lambda m, x: m(x))(model, ids), atol=2e-5)
    if window is not None:  # a ring buffer of the window, however long the sequence
        layer = cache.layers if scan else cache.layers[0]
        assert layer.key.shape[-2] == window


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone(side):
    model = _decoder(position="rope", attention={"sliding_window": 5})
    ids = _ids(batch=3)
    lengths = [SEQ, SEQ - 4, SEQ - 2]
    mask = np.zeros((3, SEQ), bool)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, SEQ - length:] = True
        else:
            mask[row, :length] = True
    batched, _ = _cached_logits(model, ids, jnp.asarray(mask), prefill=8)
    for row in range(len(lengths)):
        alone = model(ids[row:row + 1][:, mask[row]])
        chex.assert_trees_all_close(batched[row][mask[row]], alone[0], atol=2e-5)


def test_cache_rejects_positions_and_xl():
    model = _decoder(position="rope")
    cache = model.init_cache(2, 16)
    with pytest.raises(ValueError, match="position_ids"):
        model(_ids(), position_ids=jnp.arange(SEQ), cache=cache)
    with pytest.raises(ValueError, match="learned position table"):
        _decoder(position="learned").init_cache(2, 33)


@pytest.mark.parametrize(("position", "scan"), [("t5", False), ("learned", True)])
def test_encoder_decoder_cached_decoding(position, scan):
    config = EncoderDecoderConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4, d_ff=48,
                                  max_len=32, position=position, num_decoder_layers=3,
                                  compute={"scan_layers": scan})
    model = EncoderDecoder(config, rngs=nnx.Rngs(0))
    source, target = _ids(seq=9), _ids(seq=7, seed=2)
    source_mask = jnp.array([[1] * 9, [1] * 6 + [0] * 3])
    full = model(source, attention_mask=source_mask, decoder_input_ids=target)
    encoded = model.encode(source, attention_mask=source_mask)
    cache = model.init_cache(encoded, 10, attention_mask=source_mask)
    outs = []
    for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, 7)]:
        logits, cache = _decode_step(model, target[:, start:stop], cache)
        outs.append(logits)
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1), full, atol=2e-5)
    with pytest.raises(ValueError, match="come from the cache"):
        model.decode(target, encoded, cache=cache)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_transformer_xl_memory_covering_the_sequence_equals_full(scan):
    """With memory for every earlier token, segment recurrence is plain causal attention."""
    model = _decoder(position="xl", compute={"scan_layers": scan}, attention={"num_kv_heads": None})
    ids = _ids()
    got, memory = _cached_logits(model, ids, max_len=SEQ)
    chex.assert_trees_all_close(got, nnx.jit(lambda m, x: m(x))(model, ids), atol=2e-5)
    hidden = memory.hidden if scan else memory.hidden[0]
    assert hidden.shape[-2:] == (SEQ, 32) and bool(memory.valid.all())


def test_transformer_xl_memory_is_truncated_and_carries_no_gradient():
    model = _decoder(position="xl", attention={"num_kv_heads": None})
    ids = _ids(seq=8)
    memory = model.init_cache(2, 3)
    _, memory = model(ids[:, :4], cache=memory)
    chex.assert_shape(memory.hidden[0], (2, 3, 32))  # only the last mem_len tokens stay
    graphdef, params = nnx.split(model)

    def second_segment_loss(params):
        model = nnx.merge(graphdef, params)
        _, memory = model(ids[:, :4], cache=model.init_cache(2, 3))
        return model(ids[:, 4:], cache=memory)[0].sum()

    def with_constant_memory(params):
        return nnx.merge(graphdef, params)(ids[:, 4:], cache=memory)[0].sum()

    # Dai et al.: the memory is SG(h): the second segment's loss does not reach back into the
    # first segment's computation.
    chex.assert_trees_all_close(jax.grad(second_segment_loss)(params),
                                jax.grad(with_constant_memory)(params), atol=1e-5)
