"""Tiny random causal LMs in transformers and in tfx, and transformers' generate on left-padded
prompts, shared by the processor and decoder beam-search tests (tests/generation); random
left-padded prompts for the speculative and hybrid decoding tests."""

import numpy as np
import pytest
from causal_lm_parity import PROMPTS, hf_causal_lm, left_padded, through_folder

NEW = 12  # new tokens per row
PAD = 1  # filler after EOS; not 0: transformers' beam search fills with EOS when pad is 0
# GPT-2 (tied head, learned positions) and LLaMA with grouped-query attention (2 KV heads).
CASES = {
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64)),
    "llama-gqa": ("LlamaForCausalLM", dict(
        vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
}


def prompts():
    """PROMPTS left-padded with id 0: ids, mask int64 [3, 7]."""
    return left_padded(PROMPTS)


def random_prompts(vocab: int):
    """Three left-padded prompts of 9, 4 and 6 random ids below `vocab`: ids, mask int [3, 9]
    (the speculative and hybrid decoding tests)."""
    ids = np.random.default_rng(0).integers(0, vocab, (3, 9))
    mask = np.ones_like(ids)
    mask[1, :5], mask[2, :3] = 0, 0
    return ids, mask


def load_pair(torch, transformers, case: str, folder):
    """(transformers' model, the tfx model read back from its save_pretrained folder)."""
    architecture, fields = CASES[case]
    hf_model = hf_causal_lm(torch, transformers, architecture, fields)
    hf_model.generation_config.eos_token_id = None  # the tests name their EOS, if any
    return hf_model, through_folder(hf_model, folder)


def pairs_fixture():
    """A module-scoped fixture for a test module to bind (`pairs = pairs_fixture()`): (torch,
    transformers, a function case -> `load_pair(...)`, each case built once, when first
    asked for)."""
    @pytest.fixture(scope="module")
    def pairs(tmp_path_factory):
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        built = {}

        def pair(case):
            if case not in built:
                built[case] = load_pair(torch, transformers, case,
                                        tmp_path_factory.mktemp(case))
            return built[case]

        return torch, transformers, pair

    return pairs


def hf_generate(torch, hf_model, ids, mask, **kwargs) -> np.ndarray:
    """transformers' greedy or beam generate (kwargs: its generation arguments) of NEW tokens,
    int64 [rows, prompt + NEW]: padded with PAD to the full width (transformers stops at the
    longest row)."""
    return hf_generate_scored(torch, hf_model, ids, mask, **kwargs)[0]


def hf_generate_scored(torch, hf_model, ids, mask, **kwargs):
    """`hf_generate`'s tokens and transformers' `sequences_scores` (beam search; else None)."""
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                do_sample=False, max_new_tokens=NEW, pad_token_id=PAD,
                                return_dict_in_generate=True, output_scores=True, **kwargs)
    tokens = out.sequences.numpy()
    tokens = np.pad(tokens, ((0, 0), (0, ids.shape[1] + NEW - tokens.shape[1])),
                    constant_values=PAD)
    scores = getattr(out, "sequences_scores", None)
    return tokens, None if scores is None else scores.numpy()
