"""A checkpoint decodes with its own generation defaults, as transformers' `generate` does.

A tiny random LLaMA is written by transformers' save_pretrained with EOS ids (a list, one that
each row reaches early in greedy decoding) and a pad id, either in generation_config.json or,
with no generation_config.json, in config.json (transformers' `from_model_config` reads
them there). transformers' `generate` with no generation arguments but max_new_tokens stops
once every row has produced an EOS and pads finished rows; `tfx.generate(tfx.hf.load(folder),
...)` with the same arguments gives the same tokens (tfx keeps all max_new_tokens columns, the
rest padding). Before, tfx ignored the checkpoint's EOS and ran the full length. `tfx.hf.save`
writes the config back as generation_config.json, which transformers reads.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from causal_lm_parity import PROMPTS, hf_causal_lm, left_padded  # noqa: E402

import tfx  # noqa: E402
import tfx.hf  # noqa: E402

FIELDS = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
NEW, PAD = 12, 98


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"generation_config.json" | "config.json": a save_pretrained folder whose EOS ids and
    pad id are in that file}, and the EOS ids."""
    hf_model = hf_causal_lm(torch, transformers, "LlamaForCausalLM", FIELDS, seed=1, scale=0.3)
    hf_model.generation_config.eos_token_id = None
    ids, mask = left_padded(PROMPTS)
    free = _hf_generate(hf_model, ids, mask)[:, ids.shape[1]:]
    eos = [int(free[row, 2 + row]) for row in range(len(PROMPTS))]  # every row ends early
    assert PAD not in eos, free
    hf_model.generation_config.eos_token_id, hf_model.generation_config.pad_token_id = eos, PAD
    generation = tmp_path_factory.mktemp("generation")
    hf_model.save_pretrained(generation)
    legacy = tmp_path_factory.mktemp("legacy")
    shutil.copytree(generation, legacy, dirs_exist_ok=True)
    (legacy / "generation_config.json").unlink()
    config = json.loads((legacy / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps({**config, "eos_token_id": eos,
                                                    "pad_token_id": PAD}))
    return {"generation_config.json": generation, "config.json": legacy}, eos


def _hf_generate(model, ids, mask) -> np.ndarray:
    """transformers' generate with the model's generation config, NEW new tokens."""
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                              max_new_tokens=NEW).numpy()


@pytest.mark.parametrize("source", ["generation_config.json", "config.json"])
def test_greedy_generate_stops_at_the_checkpoints_eos_like_transformers(folders, source):
    folder = folders[0][source]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                               attn_implementation="eager")
    ids, mask = left_padded(PROMPTS)
    expected = _hf_generate(theirs.eval(), ids, mask)
    width = ids.shape[1] + NEW
    assert expected.shape[1] < width  # every row reached an EOS: transformers stopped early
    expected = np.pad(expected, ((0, 0), (0, width - expected.shape[1])), constant_values=PAD)

    model = tfx.hf.load(folder)
    assert model.generation_config.eos_token_id == tuple(folders[1])
    np.testing.assert_array_equal(
        tfx.generate(model, ids, attention_mask=mask, max_new_tokens=NEW), expected)


def test_save_writes_the_generation_config_transformers_reads(folders, tmp_path):
    model = tfx.hf.load(folders[0]["generation_config.json"])
    model.generation_config = dataclasses.replace(model.generation_config, do_sample=True,
                                                  temperature=0.6, top_p=0.9)
    tfx.hf.save(model, tmp_path, architecture="LlamaForCausalLM")
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (theirs.eos_token_id, theirs.pad_token_id) == (folders[1], PAD)
    assert (theirs.do_sample, theirs.temperature, theirs.top_p) == (True, 0.6, 0.9)
    assert tfx.hf.load(tmp_path).generation_config == model.generation_config
