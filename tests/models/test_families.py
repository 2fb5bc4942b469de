"""Family cards (tfx.models.families): jax-free data, each a diff of its parent, whose named
sizes `tfx.models.create` builds with the published parameter counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tfx.models import families
from tfx.models.config import EncoderConfig, EncoderDecoderConfig
from tfx.models.families import FAMILIES, LLAMA, SIZES, Family

# Published parameter counts of the named sizes (model cards on the Hugging Face hub; BERT's
# with the tfx encoder's masked-LM transform).
PUBLISHED = {"llama2-7b": 6.74e9, "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9,
             "qwen2.5-0.5b": 0.494e9, "qwen3-0.6b": 0.596e9, "qwen3-30b-a3b": 30.5e9,
             "olmo2-1b": 1.48e9, "olmo2-7b": 7.30e9, "olmo3-7b": 7.30e9, "olmo3-32b": 32.2e9,
             "phi3-mini-4k": 3.82e9,
             "gemma2-2b": 2.61e9, "gemma3-1b": 1.0e9, "pythia-160m": 0.162e9,
             "gpt2-small": 0.124e9, "gpt2-medium": 0.355e9, "bert-base": 0.110e9,
             "minilm-l6": 22.7e6, "modernbert-base": 149e6, "modernbert-large": 395e6,
             "t5-small": 60.5e6,
             "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9,
             # Their model cards' round totals; tfx counts the text model alone (no
             # multi-token-prediction head, no vision encoder).
             "qwen3-next-80b-a3b": 80e9, "qwen3.5-27b": 27e9, "qwen3.5-35b-a3b": 35e9}
# tfx's own sizes, which no checkpoint publishes.
OWN = {"llama-tiny", "char-gpt", "char-moe", "transformer-base",
       "gemma4-text"}  # transformers' Gemma4TextConfig defaults, no published checkpoint


def test_cards_import_without_jax():
    code = ("import sys, tfx.models.families, tfx.models.presets\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]"


def test_every_size_is_a_model_of_its_family_and_has_a_published_count():
    assert set(PUBLISHED) == set(SIZES) - OWN
    for name, card in SIZES.items():
        assert card.mismatches(families.size_config(name)) == {}, name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_create_builds_a_named_size(name):
    """`create` takes a size's name; its abstract parameters (no memory) count as published."""
    import jax
    from flax import nnx

    from tfx.models import create

    model = nnx.eval_shape(lambda: create(name, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == pytest.approx(PUBLISHED[name], rel=0.02)
    assert model.config == families.size_config(name)


def test_a_shrunk_size_runs():
    import jax.numpy as jnp
    from flax import nnx

    from tfx.models import create

    model = create("olmo2-1b", rngs=nnx.Rngs(0), vocab_size=64, d_model=32, num_layers=1,
                   num_heads=4, d_ff=48, embeddings={"pad_id": 0})
    assert model(jnp.zeros((1, 5), jnp.int32)).shape == (1, 5, 64)


def test_but_changes_only_what_it_names():
    child = LLAMA.but(name="child", norm={"eps": 1e-6, "outputs": True}, free={"mlp.parallel"})
    assert child.parent == "llama" and child.sizes == {}
    assert dict(child.fixed) == {**LLAMA.fixed, "norm.eps": 1e-6, "norm.outputs": True}
    assert child.free == (LLAMA.free - {"norm.eps"}) | {"mlp.parallel"}
    # Freeing a field the parent fixes unfixes it; removing a part drops the parent's fields.
    freed = child.but(name="freed", free={"norm.kind"})
    assert "norm.kind" not in freed.fixed and freed.is_free("norm.kind")
    dense = families.MIXTRAL.but(name="dense", moe=None)
    assert not any(name.startswith("moe.") for name in dense.fixed)
    with pytest.raises(ValueError, match="not fields of DecoderConfig"):
        LLAMA.but(name="typo", norm={"kidn": "layer"})


def test_every_card_but_the_roots_is_a_diff_of_its_parent():
    for card in FAMILIES.values():
        if card.parent is not None:
            parent = FAMILIES[card.parent]
            named = {k for k, v in card.fixed.items() if parent.fixed.get(k, ...) != v}
            assert named or card.free != parent.free, f"{card.name} repeats {parent.name}"


def test_fields_a_card_does_not_name_keep_their_defaults():
    """A layer part that a card does not name is refused: no family lists what it is not."""
    config = families.size_config("qwen3-0.6b")
    assert families.QWEN3.mismatches(config.replace(mlp={"parallel": True})) == {
        "mlp.parallel": (True, False)}
    assert families.QWEN3.mismatches(config.replace(moe={"num_experts": 4})) == {
        "moe": ("present", None)}
    assert families.QWEN3_MOE.mismatches(config) == {"moe": (None, "present")}
    # Spelled-out defaults mean the same model; how a model runs is no family's business.
    assert families.QWEN3.mismatches(config.replace(
        attention={"qkv_bias": False}, compute={"remat": True}, dropout=0.1)) == {}


def test_a_size_or_converter_cannot_set_what_the_card_fixes():
    with pytest.raises(ValueError, match="fixes"):
        LLAMA.config({"norm.kind": "layer", "vocab_size": 8, "d_model": 8, "num_layers": 1,
                      "num_heads": 1, "d_ff": 8})
    with pytest.raises(ValueError, match="sets"):
        Family(name="bad", fixed={"norm.kind": "rms"}, sizes={"x": {"norm.kind": "layer"}})


def test_a_card_builds_the_config_class_of_its_kind():
    """BERT's card builds EncoderConfigs, T5's EncoderDecoderConfigs; a child keeps its kind."""
    assert type(families.size_config("bert-base")) is EncoderConfig
    assert type(families.size_config("t5-small")) is EncoderDecoderConfig
    child = families.BERT.but(name="bert_rms", norm={"kind": "rms"})
    assert child.kind is EncoderConfig and child.parent == "bert"
    with pytest.raises(ValueError, match="not fields of EncoderConfig"):
        families.BERT.but(name="typo", logit_softcap=30.0)  # a decoder's field


def test_an_encoder_card_names_what_a_config_lacks():
    config = families.size_config("bert-base")
    assert families.BERT.mismatches(config.replace(norm={"pre_norm": True}, dropout=0.0)) == {
        "norm.pre_norm": (True, False)}
    assert families.BERT.mismatches(families.size_config("gpt2-small")) == {
        "config": ("DecoderConfig", "EncoderConfig")}
    t5 = families.size_config("t5-small")
    assert families.T5.mismatches(t5.replace(num_decoder_layers=6)) == {}  # as many as encoder's
    assert families.T5.mismatches(t5.replace(position="rope")) == {
        "rope": ("present", None), "t5": (None, "present"), "position": ("rope", "t5")}
