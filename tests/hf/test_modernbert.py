"""tfx.hf ModernBERT import/export against transformers' ModernBertModel and
ModernBertForMaskedLM (eager attention, float32): tiny random models (width 32, 4 heads of 8,
three layers, weights perturbed so that norms and biases matter) saved with save_pretrained,
loaded with tfx.hf.load, compared on a right-padded batch at the real positions; `tfx.hf.save`
read back by transformers; packed sequences; the settings refused by name; and `tfx embed` with
a ModernBERT sentence-transformers folder (mean pooling, normalised).

- "plain": the released checkpoints' shape (no biases, LayerNorms without bias, global layers 0
  and 2, the older global_attn_every_n_layers and global/local_rope_theta fields), local
  windows of ±3 tokens, narrower than the sequences.
- "biased": attention, MLP, head and norm biases, layer_types and rope_parameters spelled out,
  tanh GELU, an odd local_attention (±2).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import tfx.hf  # noqa: E402
from tfx.hf import modernbert  # noqa: E402
from tfx.models import families  # noqa: E402

MLM, BASE = "ModernBertForMaskedLM", "ModernBertModel"
SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, cls_token_id=1, sep_token_id=2)
CASES = {
    "plain": dict(SIZES, local_attention=6, global_attn_every_n_layers=2,
                  global_rope_theta=1000.0, local_rope_theta=50.0),
    "biased": dict(SIZES, local_attention=5, norm_bias=True, attention_bias=True, mlp_bias=True,
                   classifier_bias=True, hidden_activation="gelu_pytorch_tanh",
                   classifier_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={
                       "full_attention": {"rope_type": "default", "rope_theta": 500.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}),
}
SEQ = 12


def _hf(architecture: str, fields: dict):
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**fields, attn_implementation="eager")
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # non-zero biases and norm parameters, so a mix-up would show
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _inputs():
    """Right-padded batch: row 1 has 7 real tokens."""
    ids = torch.randint(3, SIZES["vocab_size"], (2, SEQ),
                        generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def _torch_outputs(model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


def _tfx_outputs(model, ids, mask, architecture: str) -> np.ndarray:
    hidden = model(jnp.asarray(ids.numpy()), attention_mask=jnp.asarray(mask.numpy()))
    return np.asarray(model.mlm_logits(hidden) if architecture == MLM else hidden)


def _assert_close_where_real(ours, theirs, mask):
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("architecture", [MLM, BASE])
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_match_transformers_and_save_round_trips(tmp_path, case, architecture):
    """Logits (MLM) or last hidden states on a padded batch; then tfx.hf.save read back by
    transformers gives the same outputs and the same layer kinds and rope bases."""
    theirs = _hf(architecture, CASES[case])
    theirs.save_pretrained(tmp_path / "hf")
    ours = tfx.hf.load(tmp_path / "hf")
    ids, mask = _inputs()
    expected = _torch_outputs(theirs, ids, mask)
    _assert_close_where_real(_tfx_outputs(ours, ids, mask, architecture), expected, mask)

    tfx.hf.save(ours, tmp_path / "tfx", architecture=architecture)
    back = getattr(transformers, architecture).from_pretrained(
        tmp_path / "tfx", attn_implementation="eager").eval()
    _assert_close_where_real(_torch_outputs(back, ids, mask), expected, mask)
    assert back.config.layer_types == theirs.config.layer_types
    assert back.config.rope_parameters == theirs.config.rope_parameters
    assert back.config.sliding_window == theirs.config.sliding_window


def test_config_mapping():
    c = modernbert.config_from_hf(CASES["plain"], MLM)
    assert c.attention.layer_types == ("full", "sliding", "full")
    assert c.attention.sliding_window == 4  # ±3 tokens: distances under 4
    assert (c.rope.theta, c.rope.local_theta) == (1000.0, 50.0)
    assert (c.use_bias, c.norm.bias, c.norm.first_attention, c.embeddings.norm) == (
        False, False, False, True)
    assert (c.type_vocab_size, c.mlp.gated, c.mlp.activation) == (0, True, "gelu")
    assert families.MODERNBERT.mismatches(c) == {}


def test_sliding_windows_change_the_outputs(tmp_path):
    """The local layers' window is narrower than the sequence: all-global attention differs
    by several times the parity tolerance (so the parity above checks the window)."""
    theirs = _hf(MLM, CASES["plain"])
    theirs.save_pretrained(tmp_path)
    ours = tfx.hf.load(tmp_path)
    wide = tfx.hf.load(tmp_path, attention={"sliding_window": SEQ + 1})
    ids, mask = _inputs()
    assert np.abs(_tfx_outputs(ours, ids, mask, MLM) - _tfx_outputs(wide, ids, mask, MLM)
                  ).max() > 3e-4


def test_packed_sequences_match_separate_ones(tmp_path):
    """Two documents packed in one row (segment_ids, positions restarting at 0) give the hidden
    states each gives alone: windows and rotary positions follow the documents."""
    _hf(BASE, CASES["plain"]).save_pretrained(tmp_path)
    ours = tfx.hf.load(tmp_path)
    ids, _ = _inputs()
    first, second = jnp.asarray(ids[0, :7].numpy()), jnp.asarray(ids[1, :9].numpy())
    packed = ours(jnp.concatenate([first, second])[None],
                  segment_ids=jnp.asarray([[1] * 7 + [2] * 9]),
                  position_ids=jnp.asarray([list(range(7)) + list(range(9))]))
    np.testing.assert_allclose(packed[0, :7], ours(first[None])[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed[0, 7:], ours(second[None])[0], rtol=0, atol=1e-5)


def test_model_checkpoint_keeps_the_initial_mlm_head(tmp_path):
    _hf(BASE, CASES["plain"]).save_pretrained(tmp_path)
    ours = tfx.hf.load(tmp_path)
    ids, mask = _inputs()
    assert _tfx_outputs(ours, ids, mask, MLM).shape == (2, SEQ, SIZES["vocab_size"])


@pytest.mark.parametrize("field, value, message", [
    ("decoder_bias", False, "decoder_bias=False"),
    ("tie_word_embeddings", False, "tie_word_embeddings=False"),
    ("mlp_bias", True, "mlp_bias"),
    ("classifier_activation", "relu", "classifier_activation='relu'"),
    ("hidden_activation", "quick_gelu", "hidden_activation='quick_gelu'"),
    ("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0}},
     "rope_type='linear'"),
    ("layer_types", ["chunked_attention"] * 3, "chunked_attention"),
])
def test_config_from_hf_refuses_unsupported_settings_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        modernbert.config_from_hf({**CASES["plain"], field: value}, MLM)


@pytest.mark.parametrize("change, message", [
    (dict(norm={"first_attention": True}), "norm.first_attention=True"),
    (dict(type_vocab_size=2), "type_vocab_size=2"),
    (dict(mlp={"gated": False}), "mlp.gated=False"),
])
def test_config_to_hf_refuses_what_modernbert_cannot_express(change, message):
    config = modernbert.config_from_hf(CASES["plain"], MLM).replace(**change)
    with pytest.raises(ValueError, match=message):
        modernbert.config_to_hf(config, MLM)


def test_token_types_are_refused_without_a_table(tmp_path):
    _hf(BASE, CASES["plain"]).save_pretrained(tmp_path)
    ours = tfx.hf.load(tmp_path)
    ids, _ = _inputs()
    with pytest.raises(ValueError, match="type_vocab_size 0"):
        ours(jnp.asarray(ids.numpy()), token_type_ids=jnp.zeros(ids.shape, jnp.int32))


# A word-level tokenizer over the tiny vocabulary: [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, words.
_WORDS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", *(f"w{i}" for i in range(4, SIZES["vocab_size"]))]
TEXTS = ["w5 w17 w40", "w8 w9 w10 w11 w12 w13 w14 w15 w16 w20 w30", "w77"]


def _sentence_folder(folder, model) -> None:
    """A sentence-transformers folder: `model` with its tokenizer.json at the top, mean
    pooling, Normalize."""
    tokenizers = pytest.importorskip("tokenizers")
    model.save_pretrained(folder)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {word: i for i, word in enumerate(_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tokenizer.save(str(folder / "tokenizer.json"))
    modules = [{"idx": i, "name": str(i), "path": path,
                "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": SIZES["hidden_size"], "pooling_mode_mean_tokens": True}))
    (folder / "2_Normalize").mkdir()


def test_tfx_embed_with_a_modernbert_sentence_folder(tmp_path):
    """`tfx embed --model FOLDER` against the recipe written out with transformers: the same
    word pieces, ModernBertModel's hidden states mean-pooled over the mask, L2-normalised."""
    from tfx.cli import main

    theirs = _hf(BASE, CASES["plain"])
    _sentence_folder(tmp_path, theirs)
    ids = [[1, *(_WORDS.index(word) for word in text.split()), 2] for text in TEXTS]
    width = max(map(len, ids))
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    ids = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    with torch.no_grad():
        hidden = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1),
                                             dim=1).numpy()
    assert main(["embed", *TEXTS, "--model", str(tmp_path), "--output",
                 str(tmp_path / "e.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), expected, rtol=0, atol=1e-5)
