"""config.json's pad_token_id becomes the model config's embeddings.pad_id (the filler that
tfx.generate writes after EOS) and is written back on export; T5's is 0 when it names none."""

import pytest

from tfx.hf import gpt2, llama, t5

LLAMA = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, hidden_act="silu",
             max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=128)
T5 = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=4, d_kv=8, d_ff=64)


@pytest.mark.parametrize(("module", "architecture", "fields"), [
    (llama, "LlamaForCausalLM", LLAMA), (gpt2, "GPT2LMHeadModel", GPT2),
    (t5, "T5ForConditionalGeneration", T5)])
@pytest.mark.parametrize("pad", [None, 3])
def test_pad_token_id_round_trips(module, architecture, fields, pad):
    hf = {**fields, "architectures": [architecture]}
    if pad is not None:
        hf["pad_token_id"] = pad
    config = module.config_from_hf(hf, architecture)
    expected = 0 if pad is None and module is t5 else pad
    assert config.embeddings.pad_id == expected
    assert module.config_to_hf(config, architecture)["pad_token_id"] == (
        0 if expected is None and module is t5 else expected)
