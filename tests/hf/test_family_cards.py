"""The tfx.hf converters read the family cards (tfx.models.families): what a config.json gives
is sizes, what a family is comes from its card, and a save checks a model against the card."""

from __future__ import annotations

import importlib

import pytest

from tfx.hf import decoder_parts
from tfx.hf.families import by_architecture
from tfx.models import families

# Named size -> the architecture it saves as.
ARCHITECTURES = {
    "llama2-7b": "LlamaForCausalLM", "mistral-7b": "MistralForCausalLM",
    "mixtral-8x7b": "MixtralForCausalLM", "qwen2.5-0.5b": "Qwen2ForCausalLM",
    "qwen3-0.6b": "Qwen3ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
    "qwen3-next-80b-a3b": "Qwen3NextForCausalLM", "qwen3.5-27b": "Qwen3_5ForCausalLM",
    "qwen3.5-35b-a3b": "Qwen3_5MoeForCausalLM",
    "olmo2-1b": "Olmo2ForCausalLM", "olmo2-7b": "Olmo2ForCausalLM",
    "olmo3-7b": "Olmo3ForCausalLM", "olmo3-32b": "Olmo3ForCausalLM",
    "gpt-oss-20b": "GptOssForCausalLM", "gpt-oss-120b": "GptOssForCausalLM",
    "phi3-mini-4k": "Phi3ForCausalLM", "gemma2-2b": "Gemma2ForCausalLM",
    "gemma3-1b": "Gemma3ForCausalLM", "gemma4-text": "Gemma4ForCausalLM",
    "pythia-160m": "GPTNeoXForCausalLM",
    "gpt2-small": "GPT2LMHeadModel", "gpt2-medium": "GPT2LMHeadModel",
    "llama-tiny": "LlamaForCausalLM", "char-gpt": "LlamaForCausalLM",
    "char-moe": "MixtralForCausalLM", "bert-base": "BertModel", "minilm-l6": "BertModel",
    "modernbert-base": "ModernBertForMaskedLM", "modernbert-large": "ModernBertForMaskedLM",
    "t5-small": "T5ForConditionalGeneration"}
# What a save and load change in a size beyond its dropout (off: a load is for inference), in
# fields that do not change the model: T5's config.json names a padding token (0) where the
# model has none; a Mixtral has no dense MLP, and one width for its experts and its d_ff.
LOADED = {"t5-small": {"embeddings": {"pad_id": 0}}, "char-moe": {"d_ff": 512}}
# Public config.json fields (the sizes only) of some named sizes, as the hub has them.
PUBLIC = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000,
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False)),
    "olmo2-1b": ("Olmo2ForCausalLM", dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=500000, tie_word_embeddings=False, pad_token_id=100277,
        attention_bias=False)),
    "gemma2-2b": ("Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, max_position_embeddings=8192, rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10000.0,
        pad_token_id=0)),
    "modernbert-base": ("ModernBertForMaskedLM", dict(
        vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
        num_attention_heads=12, hidden_activation="gelu", max_position_embeddings=8192,
        norm_eps=1e-5, norm_bias=False, global_attn_every_n_layers=3, local_attention=128,
        global_rope_theta=160000.0, local_rope_theta=10000.0, attention_bias=False,
        mlp_bias=False, classifier_bias=False, decoder_bias=True, pad_token_id=50283,
        cls_token_id=50281, sep_token_id=50282, bos_token_id=50281, eos_token_id=50282)),
}


def test_every_size_saves_under_a_family_converter():
    """Every size but those of tfx's own Transformer family, which has no converter."""
    own = set(families.TRANSFORMER.sizes)
    assert set(ARCHITECTURES) == set(families.SIZES) - own


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_size_round_trips_through_its_config_json(name):
    """config_to_hf then config_from_hf: the same model (spelled-out defaults aside)."""
    architecture = ARCHITECTURES[name]
    family = by_architecture()[architecture]
    config = families.size_config(name)
    back = family.config_from_hf(family.config_to_hf(config, architecture), architecture)
    expected = config.replace(dropout=0.0, **LOADED.get(name, {}))
    assert families.canonical(back) == families.canonical(expected)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_a_public_config_json_reads_as_its_named_size(name):
    architecture, hf = PUBLIC[name]
    config = by_architecture()[architecture].config_from_hf(hf, architecture)
    assert families.canonical(config) == families.canonical(families.size_config(name))


@pytest.mark.parametrize("module", ["bert", "deepseek", "gemma", "gpt2", "gpt_neox", "gpt_oss",
                                    "llama", "mixtral", "modernbert", "olmo2", "olmo3", "phi3",
                                    "qwen", "qwen3_5", "qwen3_next", "smollm3", "t5"])
def test_a_default_config_json_reads_as_a_model_of_the_card(module):
    family = importlib.import_module(f"tfx.hf.{module}")
    for architecture in family.ARCHITECTURES:
        config = family.config_from_hf({}, architecture)
        card = getattr(family, "CARDS", {}).get(architecture) or family.CARD
        assert card.mismatches(config) == {}, architecture


def test_the_export_check_names_every_field_the_card_lacks():
    config = families.size_config("qwen3-0.6b").replace(norm={"outputs": True}, logit_softcap=3.0)
    with pytest.raises(ValueError, match=r"norm\.outputs=True .*; logit_softcap=3\.0"):
        decoder_parts.check_card(config, "Qwen3ForCausalLM", families.QWEN3)
    with pytest.raises(ValueError, match="it needs moe"):
        decoder_parts.check_card(config, "Qwen3MoeForCausalLM", families.QWEN3_MOE)
