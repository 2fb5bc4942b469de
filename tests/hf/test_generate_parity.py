"""Greedy `tfx.generate` against Hugging Face `generate(do_sample=False)`, token for token.

Tiny random checkpoints (eager attention, float32, weights perturbed so that argmax decisions
are not degenerate) are saved with `save_pretrained` and read back with `tfx.hf.load`:

- GPT-2 (head tied to wte, learned positions) and LLaMA with GQA: a batch of prompts of
  different lengths, left-padded as HF requires for decoder-only batches. tfx gets the same
  ids and mask, and also the prompts right-padded: both give HF's tokens.
- Mistral with sliding_window=4, a 7-token prompt and 20 new tokens, so tfx's ring-buffer cache
  wraps many times. HF's generate builds `DynamicCache(config=...)`, whose layers are
  `DynamicSlidingWindowLayer`s keeping only the last window - 1 keys: the reference decodes
  with the window too (checked), and the window changes the tokens (checked). The right-padded
  run here also skips prompt bucketing (prefill of 7 tokens into a ring of 4).
- T5 (relative attention buckets): a right-padded batch of sources; both return the decoder
  start token followed by the new tokens.
- EOS: with an eos_token_id that HF emits mid-way through one row, that row ends and is filled
  with pad_token_id while the others go on (HF stops once every row is done; its output is
  padded to the full length for the comparison).

HF's generation_config carries the checkpoint's eos_token_id; the parity tests set it to None so
that no row stops early and both sides return max_new_tokens tokens.
"""

import functools

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import perturb, through_folder  # noqa: E402
from transformers import cache_utils  # noqa: E402

import tfx  # noqa: E402
import tfx.hf  # noqa: E402

VOCAB = 99
PROMPTS = [[5, 17, 42, 8, 33, 71, 12], [9, 64, 3], [22, 7, 90, 51, 14]]
SOURCES = [[5, 17, 42, 8, 33, 71, 12, 60, 2], [9, 64, 3, 27], [22, 7, 90, 51, 14, 88]]
NEW = 12
WINDOW, MISTRAL_NEW = 4, 20
DECODER_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rms_norm_eps=1e-6, attn_implementation="eager")


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER_BASE))


def _mistral(sliding_window=WINDOW):
    config = transformers.MistralConfig(**DECODER_BASE, sliding_window=sliding_window)
    return transformers.MistralForCausalLM(config)


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        attn_implementation="eager")
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():  # transformers 5 ties T5's lm_head at init; a v1.1 checkpoint has its own
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32))
    return model


BUILDERS = {"gpt2": _gpt2, "llama-gqa": _llama, "mistral-window": _mistral, "t5": _t5}


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """name -> (torch model, tfx model loaded from its save_pretrained folder), built once."""

    @functools.cache
    def load(name: str):
        torch.manual_seed(1)  # a seed whose greedy continuations are varied
        hf_model = perturb(torch, BUILDERS[name]().eval(), scale=0.3)
        return hf_model, through_folder(hf_model, tmp_path_factory.mktemp(name))

    return load


def _pad(rows, side: str):
    """ids, mask int64 [len(rows), longest row] with each row's tokens on the left or right
    (padding ids are 0)."""
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask


def _hf_generate(model, ids, mask, max_new_tokens, *, eos_token_id=None, pad_token_id=0,
                 **kwargs):
    """HF greedy decoding: int [batch, prompt_len + new] (decoders) or [batch, 1 + new] (T5);
    shorter when every row reached eos_token_id."""
    config = model.generation_config  # overriding it: None passed to generate() means "default"
    config.eos_token_id, config.pad_token_id = eos_token_id, pad_token_id
    if model.config.is_encoder_decoder:
        # transformers 5.x sizes the decoder's DynamicCache(config=...) by num_layers, not
        # num_decoder_layers (IndexError when the decoder is deeper): let it grow per layer.
        kwargs.setdefault("cache", cache_utils.EncoderDecoderCache(cache_utils.DynamicCache(),
                                                                   cache_utils.DynamicCache()))
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    return out if kwargs.get("return_dict_in_generate") else out.numpy()


def _tfx_generate(model, ids, mask, max_new_tokens, **kwargs) -> np.ndarray:
    kwargs.setdefault("eos_token_id", [])  # as HF's, with its generation config's EOS unset
    return np.asarray(tfx.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   temperature=0.0, **kwargs))


def _assert_not_degenerate(new_tokens):
    """Each row visits several tokens, so that the comparison says something."""
    for row in new_tokens:
        assert len(set(row.tolist())) >= 3, new_tokens


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_decoder_batch_matches_hf_left_and_right_padded(load, name):
    hf_model, model = load(name)
    ids, mask = _pad(PROMPTS, "left")
    expected = _hf_generate(hf_model, ids, mask, NEW)
    prompt_len = ids.shape[1]
    assert expected.shape == (len(PROMPTS), prompt_len + NEW)
    _assert_not_degenerate(expected[:, prompt_len:])

    left = _tfx_generate(model, ids, mask, NEW)
    assert left.dtype == np.int32
    np.testing.assert_array_equal(left, expected)

    right_ids, right_mask = _pad(PROMPTS, "right")
    right = _tfx_generate(model, right_ids, right_mask, NEW)  # same bucket: no recompile
    np.testing.assert_array_equal(right[:, :prompt_len], right_ids)
    np.testing.assert_array_equal(right[:, prompt_len:], expected[:, prompt_len:])


def test_mistral_sliding_window_past_the_window_matches_hf(load):
    hf_model, model = load("mistral-window")
    prompts = [PROMPTS[0], PROMPTS[2]]  # 7 and 5 tokens, both longer than the window
    ids, mask = _pad(prompts, "left")
    out = _hf_generate(hf_model, ids, mask, MISTRAL_NEW, return_dict_in_generate=True)
    expected = out.sequences.numpy()
    # HF decodes through a sliding-window cache that holds window - 1 keys per layer.
    assert {type(layer).__name__ for layer in out.cache.layers} == {"DynamicSlidingWindowLayer"}
    assert out.cache.layers[0].keys.shape[-2] == WINDOW - 1
    assert expected.shape == (2, 7 + MISTRAL_NEW)
    _assert_not_degenerate(expected[:, 7:])

    # tfx's cache is a ring buffer of the window, far shorter than prompt + new tokens.
    cache = model.init_cache(2, 7 + MISTRAL_NEW)
    assert cache.window == WINDOW
    assert {leaf.shape[-2] for leaf in jax.tree.leaves(cache.layers)} == {WINDOW}

    np.testing.assert_array_equal(_tfx_generate(model, ids, mask, MISTRAL_NEW), expected)
    right_ids, right_mask = _pad(prompts, "right")
    right = _tfx_generate(model, right_ids, right_mask, MISTRAL_NEW, bucket=False)  # 7 wide
    np.testing.assert_array_equal(right[:, 7:], expected[:, 7:])

    # The window matters: the same weights with full attention continue differently.
    full = _mistral(sliding_window=None).eval()
    full.load_state_dict(hf_model.state_dict())
    assert (_hf_generate(full, ids, mask, MISTRAL_NEW)[:, 7:] != expected[:, 7:]).any()


def test_t5_batch_matches_hf(load):
    hf_model, model = load("t5")
    ids, mask = _pad(SOURCES, "right")
    expected = _hf_generate(hf_model, ids, mask, NEW)
    assert expected.shape == (len(SOURCES), 1 + NEW)
    assert (expected[:, 0] == hf_model.config.decoder_start_token_id).all()
    _assert_not_degenerate(expected[:, 1:])
    np.testing.assert_array_equal(_tfx_generate(model, ids, mask, NEW), expected)


def _eos_stopping_row_0(new_tokens) -> int:
    """A token that row 0 first produces mid-way while another row has not produced it yet, so
    that row 0 stops and the loop goes on for the others."""
    for step in range(2, new_tokens.shape[1] - 3):
        token = int(new_tokens[0, step])
        if token not in new_tokens[0, :step] and \
                any(token not in row[:step + 1] for row in new_tokens[1:]):
            return token
    raise AssertionError(f"no token stops row 0 mid-way in {new_tokens}; change the seed")


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_eos_stops_a_row_and_pads_it_like_hf(load, name):
    hf_model, model = load(name)
    t5 = name == "t5"
    ids, mask = _pad(SOURCES if t5 else PROMPTS, "right" if t5 else "left")
    start = 1 if t5 else ids.shape[1]  # where the new tokens begin
    free = _hf_generate(hf_model, ids, mask, NEW)
    eos = _eos_stopping_row_0(free[:, start:])
    pad = VOCAB - 1 if eos != VOCAB - 1 else VOCAB - 2

    expected = _hf_generate(hf_model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    width = start + NEW  # HF stops once every row is done: pad it to the full length
    expected = np.pad(expected, ((0, 0), (0, width - expected.shape[1])), constant_values=pad)
    stop = start + list(free[0, start:]).index(eos)
    assert expected[0, stop] == eos and (expected[0, stop + 1:] == pad).all()
    assert (expected[:, stop + 1:] != pad).any()  # another row went on

    ours = _tfx_generate(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    np.testing.assert_array_equal(ours, expected)
