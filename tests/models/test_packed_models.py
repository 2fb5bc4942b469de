"""Packed rows (tfx.train.packing) compute each document exactly as if it were alone: the
decoder (RoPE and learned positions), the BERT encoder (MLM logits) and the encoder-decoder
(T5's relative bias), with segment ids and per-document positions."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.models import create
from tfx.train.packing import pack

SMALL = dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, vocab_size=97, dropout=0.0)
ROW = 16
TOL = dict(atol=1e-5, rtol=1e-5)


def _documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 97, n).astype(np.int32) for n in lengths]


def _one_row(documents):
    """The documents packed into a single row of ROW tokens: (tokens, segments, positions),
    each int32 [1, ROW]."""
    packed = pack(documents, ROW)
    assert packed.tokens.shape[0] == 1, "the test documents must fit one row"
    return tuple(jnp.asarray(a.astype(np.int32)) for a in
                 (packed.tokens, packed.segment_ids, packed.positions))


def _slices(segments):
    """Column slices of segments 1, 2, ... of a one-row segment array [1, ROW]."""
    seg = np.asarray(segments[0])
    return [np.flatnonzero(seg == s) for s in range(1, seg.max() + 1)]


@pytest.mark.parametrize("name", ["char-gpt", "gpt2-small"])  # RoPE, learned positions
def test_decoder_packed_row_equals_documents_alone(name):
    overrides = {"attention": {"num_kv_heads": 2}} if name == "char-gpt" else {}
    model = create(name, rngs=nnx.Rngs(0), **SMALL, **overrides)
    documents = _documents([5, 7, 3])
    tokens, segments, positions = _one_row(documents)
    packed = model(tokens, position_ids=positions, segment_ids=segments)
    for doc, cols in zip(documents, _slices(segments), strict=True):
        chex.assert_trees_all_close(packed[0, cols], model(doc[None])[0], **TOL)


def test_encoder_packed_row_equals_documents_alone():
    model = create("bert-base", rngs=nnx.Rngs(0), **SMALL)
    documents = _documents([6, 4, 5], seed=1)
    tokens, segments, positions = _one_row(documents)
    packed = model.mlm_logits(model(tokens, position_ids=positions, segment_ids=segments))
    for doc, cols in zip(documents, _slices(segments), strict=True):
        chex.assert_trees_all_close(packed[0, cols], model.mlm_logits(model(doc[None]))[0],
                                    **TOL)


def test_encoder_decoder_packed_rows_equal_examples_alone():
    model = create("t5-small", rngs=nnx.Rngs(0), **SMALL)
    sources, targets = _documents([6, 4, 5], seed=2), _documents([3, 7, 2], seed=3)
    src, src_segments, src_positions = _one_row(sources)
    tgt, tgt_segments, tgt_positions = _one_row(targets)
    logits = model(src, decoder_input_ids=tgt, position_ids=src_positions,
                   segment_ids=src_segments, decoder_position_ids=tgt_positions,
                   decoder_segment_ids=tgt_segments)
    for source, target, cols in zip(sources, targets, _slices(tgt_segments), strict=True):
        alone = model(source[None], decoder_input_ids=target[None])
        chex.assert_trees_all_close(logits[0, cols], alone[0], **TOL)


def test_segment_ids_with_a_cache_are_refused():
    model = create("t5-small", rngs=nnx.Rngs(0), **SMALL)
    ids = jnp.ones((1, 4), jnp.int32)
    cache = model.init_cache(model.encode(ids), 8)
    with pytest.raises(ValueError, match="segment_ids"):
        model.decode(ids[:, :1], segment_ids=jnp.ones((1, 1), jnp.int32), cache=cache)
