"""Helpers shared by the causal-LM parity tests of tests/hf (GPT-2, LLaMA / Mistral, Mixtral,
Qwen, Gemma, Phi-3, OLMo 2, GPT-NeoX, DeepSeek-V3): the tiny perturbed transformers model, a
right-padded batch, logits from both sides and their comparison at real positions, the
module-scoped fixture with its logits test, greedy generation, a save read back by
transformers, and parameters compared path by path."""

import jax.numpy as jnp
import numpy as np
import pytest


def perturb(torch, model, scale: float = 0.1):
    """Norms are ones and biases zeros at init: perturb every parameter so that they matter."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn_like(param))
    return model


def hf_causal_lm(torch, transformers, architecture: str, fields: dict, *, seed: int = 0,
                 scale: float = 0.1, config_class=None):
    """transformers' `architecture` (eager attention, eval mode) from `config_class(**fields)`
    (by default the transformers class named like the architecture, `...Config`), initialised
    under torch.manual_seed(seed) and perturbed by `scale`."""
    torch.manual_seed(seed)
    if config_class is None:
        name = architecture.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config")
        config_class = getattr(transformers, name)
    config = config_class(**fields, attn_implementation="eager")
    return perturb(torch, getattr(transformers, architecture)(config).eval(), scale=scale)


def padded_inputs(seq: int, vocab_size: int = 99):
    """input_ids [2, seq] and an attention_mask whose second row is right-padded after 8."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, vocab_size, size=(2, seq))
    attention_mask = np.ones((2, seq), np.int64)
    attention_mask[1, 8:] = 0
    return input_ids, attention_mask


def torch_logits(torch, model, input_ids, attention_mask) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(input_ids),
                     attention_mask=torch.tensor(attention_mask)).logits.numpy()


def tfx_logits(model, input_ids, attention_mask) -> np.ndarray:
    return np.asarray(model(jnp.asarray(input_ids), attention_mask=jnp.asarray(attention_mask)))


def assert_close_where_real(ours, theirs, attention_mask):
    real = attention_mask.astype(bool)  # HF's logits at padded queries are not meaningful
    np.testing.assert_allclose(ours[real], theirs[real], rtol=1e-4, atol=1e-5)


def assert_logits_match(torch, ours, theirs, seq: int):
    """tfx model `ours` and torch model `theirs` agree on a right-padded batch of length seq."""
    input_ids, attention_mask = padded_inputs(seq)
    assert_close_where_real(tfx_logits(ours, input_ids, attention_mask),
                            torch_logits(torch, theirs, input_ids, attention_mask),
                            attention_mask)


def through_folder(hf_model, folder):
    """The tfx model read back from `hf_model.save_pretrained(folder)` (safetensors)."""
    import tfx.hf

    hf_model.save_pretrained(folder, safe_serialization=True)
    return tfx.hf.load(folder)


def parity_fixture(cases, hf_model):
    """A module-scoped fixture over sorted(cases): (case, torch model `hf_model(case)`, the tfx
    model read back from its save_pretrained folder)."""
    @pytest.fixture(scope="module", params=sorted(cases))
    def loaded(request, tmp_path_factory):
        model = hf_model(request.param)
        return request.param, model, through_folder(model, tmp_path_factory.mktemp(request.param))

    return loaded


def parity_tests(torch, cases, hf_model, seq: int):
    """`parity_fixture(cases, hf_model)` and the test every family runs on it: tfx's logits are
    transformers' on a right-padded batch of length seq. A test module binds both, as
    `loaded, test_logits_match_transformers = parity_tests(...)`."""
    loaded = parity_fixture(cases, hf_model)

    def test_logits_match_transformers(loaded):
        _, hf_model, model = loaded
        assert_logits_match(torch, model, hf_model, seq)

    return loaded, test_logits_match_transformers


def save_round_trips(torch, transformers, model, folder, architecture: str, seq: int):
    """`tfx.hf.save(model, folder, architecture=...)` read back by transformers is that
    architecture with `model`'s logits on a right-padded batch of length seq, and read back by
    tfx has `model`'s config. Returns transformers' model."""
    import tfx.hf

    tfx.hf.save(model, folder, architecture=architecture)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == architecture
    assert_logits_match(torch, model, reloaded, seq)
    assert tfx.hf.load(folder).config == model.config
    return reloaded


def assert_same_params(ours, theirs):
    """tfx models `ours` and `theirs` have the same parameter paths with equal values."""
    from tfx.hf import io

    ours, theirs = io.flat_params(ours), io.flat_params(theirs)
    assert ours.keys() == theirs.keys()
    for path in ours:
        np.testing.assert_array_equal(ours[path], theirs[path], err_msg=str(path))


def assert_in_memory_layout_loads(hf_model, model, folder, architecture: str, name: str):
    """transformers' in-memory parameter names (`hf_model.state_dict()`, which has `name`),
    written as they are to `folder`, load as the same tfx model as `model` (read from the
    save_pretrained files)."""
    import json

    import tfx.hf
    from tfx.hf import io

    state = {key: value.numpy() for key, value in hf_model.state_dict().items()}
    assert name in state
    config = dict(json.loads(hf_model.config.to_json_string()), architectures=[architecture])
    io.write_folder(folder, config, state)
    assert_same_params(tfx.hf.load(folder), model)


def assert_split_merge_under_jit(model, seq: int):
    """The model split by nnx and merged back inside jax.jit gives its own logits."""
    import jax
    from flax import nnx

    input_ids = jnp.asarray(padded_inputs(seq)[0])
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, input_ids)
    np.testing.assert_allclose(jitted, model(input_ids), rtol=1e-5, atol=1e-6)


# Left-padded prompts of 7, 3 and 5 tokens for the greedy-generation tests.
PROMPTS = [[5, 17, 42, 8, 33, 71, 12], [9, 64, 3], [22, 7, 90, 51, 14]]


def left_padded(rows):
    """ids, mask int64 [len(rows), longest row] with each row's tokens at the right end (the
    padding side HF's generate needs for a batch of decoder-only prompts); padding ids 0."""
    width = max(map(len, rows))
    ids, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def assert_greedy_matches(torch, ours, theirs, prompts, new_tokens: int):
    """Greedy `tfx.generate` of tfx model `ours` gives, token for token, what HF's
    generate(do_sample=False) of `theirs` gives on the left-padded `prompts`, with no EOS (both
    run the full length) and each row visiting several tokens (so that the comparison says
    something). Returns HF's output (`sequences`, `cache`)."""
    import tfx

    ids, mask = left_padded(prompts)
    config = theirs.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    with torch.no_grad():
        out = theirs.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                              do_sample=False, max_new_tokens=new_tokens,
                              return_dict_in_generate=True)
    expected = out.sequences.numpy()
    assert expected.shape == (len(prompts), ids.shape[1] + new_tokens)
    assert all(len(set(row)) >= 3 for row in expected[:, ids.shape[1]:].tolist()), expected
    generated = tfx.generate(ours, ids, attention_mask=mask, max_new_tokens=new_tokens,
                             temperature=0.0, eos_token_id=[])  # no EOS, as HF's above
    np.testing.assert_array_equal(np.asarray(generated), expected)
    return out
