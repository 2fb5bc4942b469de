"""The checkpoints the Hub has of Qwen3.5 and Gemma 3 (4B and up) are image-text models
(`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`,
`Gemma3ForConditionalGeneration`): tfx.hf.load reads their text model (tfx.hf.families.TextOf),
checked against transformers' multimodal model itself (eager attention, float32) on text.

Tiny random models, every weight perturbed, each with a one-block vision tower:

- qwen3_5: linear, full, linear, linear layers, SwiGLU MLPs, an untied head; tensors
  `model.language_model.*`, `lm_head.weight`, `model.visual.*`.
- qwen3_5_moe: three linear layers then a full one, top-2 of 4 experts and a gated shared
  expert, a tied head (no lm_head tensor).
- gemma3: a sliding layer (window 4) and a full one, a tied head; save_pretrained writes
  `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`.

Each: logits on a left-padded batch at the real positions, greedy `tfx.generate` token for
token as HF's generate on left-padded prompts, the config read from text_config with the top
level's tie_word_embeddings, transformers' in-memory names loading as the same model, and
(once) a save as the text class read back by transformers. Then sharded files assembled on
the device, the decoding defaults of a config.json without generation_config.json, and what
is refused.
"""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from causal_lm_parity import (  # noqa: E402
    PROMPTS,
    assert_close_where_real,
    assert_greedy_matches,
    assert_in_memory_layout_loads,
    assert_same_params,
    left_padded,
    perturb,
    tfx_logits,
    torch_logits,
)

import tfx.hf  # noqa: E402
from tfx.hf import gemma, placement, qwen3_5  # noqa: E402
from tfx.hf.families import TextOf, by_architecture, for_loading  # noqa: E402

SEQ, NEW = 12, 8
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                    out_hidden_size=32, patch_size=4, temporal_patch_size=2,
                    spatial_merge_size=2, num_position_embeddings=16)
_QWEN_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                  linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=6,
                  max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0)
# (config class, multimodal class, text class, text_config, top-level fields, seed)
CASES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", qwen3_5.QWEN3_5,
                dict(_QWEN_TEXT, intermediate_size=48, tie_word_embeddings=False,
                     layer_types=["linear_attention", "full_attention", "linear_attention",
                                  "linear_attention"]),
                dict(vision_config=_QWEN_VISION, tie_word_embeddings=False), 0),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    qwen3_5.QWEN3_5_MOE,
                    dict(_QWEN_TEXT, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=32,
                         tie_word_embeddings=True),
                    dict(vision_config=_QWEN_VISION, tie_word_embeddings=True), 2),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", gemma.GEMMA3,
               dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    query_pre_attn_scalar=8, sliding_window=4, max_position_embeddings=64,
                    layer_types=["sliding_attention", "full_attention"]),
               dict(vision_config=dict(hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       image_size=16, patch_size=4),
                    mm_tokens_per_image=4, image_token_index=125, boi_token_index=126,
                    eoi_token_index=127), 0),
}


def _hf_model(case: str):
    """The perturbed multimodal transformers model of `case` (eager attention, eval mode)."""
    config_class, architecture, _, text, top, seed = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(text_config=text, **top)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    return perturb(torch, getattr(transformers, architecture)(config).eval())


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    """(case, transformers' multimodal model, its save_pretrained folder, tfx's load of it)."""
    hf_model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    return request.param, hf_model, folder, tfx.hf.load(folder)


def test_the_folder_is_transformers_multimodal_layout(loaded):
    """What the loads below read: the multimodal class, its towers' tensors beside the text."""
    case, _, folder, _ = loaded
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [CASES[case][1]] and "text_config" in config
    names = set(json.loads(_header(folder / "model.safetensors")))
    tower = {"qwen3_5": "model.visual.", "qwen3_5_moe": "model.visual.",
             "gemma3": "vision_tower."}[case]
    text = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model.",
            "gemma3": "language_model.model."}[case]
    assert any(name.startswith(tower) for name in names)
    assert any(name.startswith(text) for name in names)
    assert ("lm_head.weight" in names) == (case == "qwen3_5")  # the others are tied


def _header(path) -> str:
    """The JSON header of a safetensors file."""
    data = path.read_bytes()
    return data[8:8 + int.from_bytes(data[:8], "little")].decode()


def test_logits_match_the_multimodal_model_on_left_padded_text(loaded):
    _, hf_model, _, model = loaded
    ids, mask = left_padded([list(range(3, 3 + SEQ)), [7, 40, 2, 91, 5], [60, 11, 33, 80]])
    assert_close_where_real(tfx_logits(model, ids, mask), torch_logits(torch, hf_model, ids, mask),
                            mask)


def test_greedy_generation_matches_hf_generate(loaded):
    _, hf_model, _, model = loaded
    assert_greedy_matches(torch, model, hf_model, PROMPTS, NEW)


def test_the_config_is_text_config_with_the_top_level_tie(loaded):
    case, hf_model, folder, model = loaded
    _, architecture, text_architecture, _, _, _ = CASES[case]
    hf = json.loads((folder / "config.json").read_text())
    family = by_architecture()[text_architecture]
    expected = family.config_from_hf(
        {**hf["text_config"], "tie_word_embeddings": hf["tie_word_embeddings"]},
        text_architecture)
    assert model.config == expected
    assert model.config.embeddings.tie == hf_model.config.tie_word_embeddings
    assert isinstance(for_loading()[architecture], TextOf)
    assert architecture not in tfx.hf.SUPPORTED  # read, never written: saves as the text class


def test_transformers_module_names_load_as_the_same_model(loaded, tmp_path):
    """The names of transformers' modules (state_dict: `model.language_model.*`,
    `lm_head.weight` and the towers under `model.`), the layout older saves have too."""
    case, hf_model, _, model = loaded
    assert_in_memory_layout_loads(hf_model, model, tmp_path / "in_memory", CASES[case][1],
                                  "model.language_model.norm.weight")


def _saved(case: str, folder, **options):
    """(transformers' model of `case`, tfx's load of its save_pretrained(folder, **options))."""
    hf_model = _hf_model(case)
    hf_model.save_pretrained(folder, **options)
    return hf_model, tfx.hf.load(folder)


def test_it_saves_as_the_text_class_that_transformers_reads(tmp_path):
    hf_model, model = _saved("qwen3_5", tmp_path / "multimodal")
    folder = tmp_path / "text"
    tfx.hf.save(model, folder, architecture=qwen3_5.QWEN3_5)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        qwen3_5.QWEN3_5]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == qwen3_5.QWEN3_5
    ids, mask = left_padded(PROMPTS)
    assert_close_where_real(torch_logits(torch, reloaded, ids, mask),
                            torch_logits(torch, hf_model, ids, mask), mask)


def test_sharded_files_assembled_on_the_device_load_the_same(tmp_path, monkeypatch):
    """save_pretrained's index over several files, each tensor placed by the device path."""
    hf_model, model = _saved("qwen3_5_moe", tmp_path / "single")
    folder = tmp_path / "sharded"
    hf_model.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    assert (folder / "model.safetensors.index.json").is_file()
    monkeypatch.setattr(placement, "HOST_PLATFORMS", ())
    assert_same_params(tfx.hf.load(folder), model)


def test_decoding_defaults_come_from_text_config_without_generation_config(tmp_path):
    """As transformers' GenerationConfig.from_model_config: the top level's fields, then
    text_config's for those left unset."""
    _hf_model("gemma3").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"].update(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)
    config["eos_token_id"] = 5  # the top level's wins
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = transformers.GenerationConfig.from_model_config(config)
    generation = tfx.hf.load(tmp_path).generation_config
    assert (generation.bos_token_id, generation.pad_token_id) == (
        expected.bos_token_id, expected.pad_token_id) == (2, 0)
    assert generation.eos_token_id == (expected.eos_token_id,) == (5,)


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """A saved tiny Gemma3ForConditionalGeneration, for the refusals to alter copies of."""
    folder = tmp_path_factory.mktemp("gemma_mm")
    _hf_model("gemma3").save_pretrained(folder)
    return folder


def _altered(source, target, *, config=None, tensors=None):
    """A copy of folder `source` with config.json fields and tensors replaced (None: drop)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    hf = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**hf, **(config or {})}))
    weights = load_file(target / "model.safetensors")
    for name, value in (tensors or {}).items():
        weights.pop(name) if value is None else weights.__setitem__(name, value)
    save_file(weights, target / "model.safetensors")
    return target


def test_a_multimodal_class_whose_text_model_tfx_does_not_map_is_refused(gemma_folder,
                                                                          tmp_path):
    folder = _altered(gemma_folder, tmp_path / "vl",
                      config={"architectures": ["Qwen2_5_VLForConditionalGeneration"]})
    with pytest.raises(ValueError, match=r"architectures \['Qwen2_5_VLForConditionalGeneration'\] "
                                         r"not supported; tfx loads \[.*'Gemma3ForConditional"):
        tfx.hf.load(folder)


def test_tensors_outside_the_text_model_and_the_towers_are_unexpected(gemma_folder, tmp_path):
    extra = {"audio_tower.proj.weight": np.zeros((2, 2), np.float32),
             "model.norm.weight": np.zeros(32, np.float32)}  # the text class's name, misplaced
    folder = _altered(gemma_folder, tmp_path / "extra", tensors=extra)
    with pytest.raises(ValueError, match=r"unexpected tensors \['audio_tower\.proj\.weight', "
                                         r"'model\.norm\.weight'\] \(2 in all\)"):
        tfx.hf.load(folder)
    with pytest.warns(UserWarning, match="unexpected tensors"):
        model = tfx.hf.load(folder, strict=False)
    assert_same_params(model, tfx.hf.load(gemma_folder))


def test_a_missing_text_tensor_is_named_as_the_checkpoint_names_it(gemma_folder, tmp_path):
    folder = _altered(gemma_folder, tmp_path / "missing",
                      tensors={"language_model.model.norm.weight": None})
    with pytest.raises(ValueError, match=r"tensor language_model\.model\.norm\.weight is "
                                         "missing"):
        tfx.hf.load(folder)


def test_two_layouts_mixed_are_refused(gemma_folder, tmp_path):
    norm = np.zeros(32, np.float32)
    folder = _altered(gemma_folder, tmp_path / "mixed",
                      tensors={"model.language_model.norm.weight": norm})
    with pytest.raises(ValueError, match=r"language_model\.model\.norm\.weight and "
                                         r"model\.language_model\.norm\.weight are both the "
                                         r"text model's model\.norm\.weight"):
        tfx.hf.load(folder)


def test_an_untied_head_under_a_tied_config_is_refused_naming_its_tensors(gemma_folder,
                                                                          tmp_path):
    head = np.ones((128, 32), np.float32)
    folder = _altered(gemma_folder, tmp_path / "untied",
                      tensors={"language_model.lm_head.weight": head})
    with pytest.raises(ValueError, match=r"language_model\.lm_head\.weight differs from "
                                         r"language_model\.model\.embed_tokens\.weight"):
        tfx.hf.load(folder)


def test_the_outer_tie_word_embeddings_wins_and_defaults_to_the_outer_class(gemma_folder,
                                                                           tmp_path):
    """transformers ties the head by the multimodal config's flag (text_config's is not
    read), and without one by the multimodal config class's default."""
    hf = json.loads((gemma_folder / "config.json").read_text())
    top_untied = {"tie_word_embeddings": False,
                  "text_config": {**hf["text_config"], "tie_word_embeddings": True}}
    folder = _altered(gemma_folder, tmp_path / "top", config=top_untied)
    with pytest.raises(ValueError, match=r"tensor language_model\.lm_head\.weight is missing"):
        tfx.hf.load(folder)
    family = for_loading()["Qwen3_5ForConditionalGeneration"]
    assert family.text_fields({"text_config": {"tie_word_embeddings": True}}) == {
        "tie_word_embeddings": transformers.Qwen3_5Config().tie_word_embeddings}
    assert family.text_fields({"tie_word_embeddings": True})["tie_word_embeddings"] is True


def test_text_config_must_be_an_object_and_the_text_family_refusals_name_it(gemma_folder,
                                                                           tmp_path):
    folder = _altered(gemma_folder, tmp_path / "list", config={"text_config": [1]})
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration: config\.json's "
                                         r"\"text_config\" must be a JSON object"):
        tfx.hf.load(folder)
    hf = json.loads((gemma_folder / "config.json").read_text())
    biased = {"text_config": {**hf["text_config"], "attention_bias": True}}
    folder = _altered(gemma_folder, tmp_path / "bias", config=biased)
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration text_config \(read as "
                                         r"Gemma3ForCausalLM\): .*attention_bias=True"):
        tfx.hf.folder_config(folder)
