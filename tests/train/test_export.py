"""`tfx.train.export.export_run`: a trained run as a folder transformers (and peft) read.

Runs: LoRA on a tiny Hugging Face folder (`tests/hf_folders.py`: LLaMA with a chat tokenizer),
trained a few steps through `tfx.train.pretrained.from_pretrained` (the model and tokenizer
from the folder), and a byte-level run from scratch. The reference is the run itself:
`load_run(workdir).model`'s logits must be what transformers (+ peft) computes from the
exported folder. Refusals and a failing write leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_folders import chat_model_folder  # noqa: E402
from train_cases import tiny, write_corpus  # noqa: E402

from tfx.cli import main  # noqa: E402
from tfx.models.presets import PRESETS  # noqa: E402
from tfx.train import export  # noqa: E402
from tfx.train.export import export_run, hf_architecture  # noqa: E402
from tfx.train.finetuning import LoraTuning, PromptTuning  # noqa: E402
from tfx.train.loop import train  # noqa: E402
from tfx.train.pretrained import from_pretrained  # noqa: E402
from tfx.train.run import load_run  # noqa: E402

IDS = np.array([[5, 17, 42, 8, 33, 71, 12, 90], [9, 64, 3, 22, 7, 90, 51, 14]])
SHORT = dict(steps=4, batch_size=4, seq_len=32, log_every=2, eval_every=4, eval_batches=1,
             checkpoint_every=4)
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_model_folder(torch, transformers, tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, folder):
    """A LoRA run on every projection of the folder's model; a high learning rate, so that
    four steps move the factors well away from b = 0."""
    root = tmp_path_factory.mktemp("runs")
    experiment = from_pretrained(
        folder, "gpt_char", data=str(write_corpus(root)), train=SHORT,
        optim={"learning_rate": 1e-2, "warmup_steps": 1},
        peft=LoraTuning(rank=4, targets=("query", "key", "value", "out", "gate", "up", "down")))
    train(experiment, root / "lora", progress=False)
    return root / "lora"


def _tfx_logits(workdir) -> np.ndarray:
    return np.asarray(load_run(workdir).model(IDS))


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits.numpy()


def _left_over(folder) -> list[str]:
    """Names in `folder` an export may have left (its staging folders start with a dot)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_lora_run_exports_a_peft_adapter_of_its_base(lora_run, folder, tmp_path):
    to = export_run(lora_run, tmp_path / "adapter")
    assert to == tmp_path / "adapter" and not _left_over(tmp_path)
    files = {p.name for p in to.iterdir()}
    assert ADAPTER_FILES | {"tokenizer.json", "tokenizer_config.json"} <= files
    assert "config.json" not in files  # an adapter, not a model
    config = json.loads((to / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder.resolve())
    assert (config["r"], config["task_type"]) == (4, "CAUSAL_LM")

    base = transformers.AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(base, to).eval()
    theirs = _logits(tuned)
    np.testing.assert_allclose(_tfx_logits(lora_run), theirs, rtol=1e-4, atol=1e-4)
    with tuned.disable_adapter():
        assert np.abs(_logits(tuned) - theirs).max() > 1e-3  # training moved the factors
    # The folder's tokenizer, chat template included, comes along.
    ours, original = (transformers.AutoTokenizer.from_pretrained(f) for f in (to, folder))
    chat = [{"role": "user", "content": "What is two plus two?"}]
    assert ours.apply_chat_template(chat) == original.apply_chat_template(chat)


def test_lora_run_merged_is_a_transformers_folder(lora_run, folder, tmp_path, capsys):
    (tmp_path / "merged").mkdir()  # an empty folder may be the destination
    assert main(["export", "--workdir", str(lora_run), "--to", str(tmp_path / "merged"),
                 "--merged", "True"]) == 0
    to = tmp_path / "merged"
    assert f"to {to}" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(to, attn_implementation="eager")
    assert type(model).__name__ == "LlamaForCausalLM"
    np.testing.assert_allclose(_tfx_logits(lora_run), _logits(model.eval()), rtol=1e-4,
                               atol=1e-4)
    config, original = (json.loads((f / "config.json").read_text()) for f in (to, folder))
    assert config["eos_token_id"] == original["eos_token_id"]
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in to.iterdir()}
    assert not ADAPTER_FILES & {p.name for p in to.iterdir()}


def test_qlora_run_merges_into_the_float_base(folder, tmp_path):
    """A LoRA run on a quantized base (QLoRA) merges its factors into the base's float weights:
    transformers' merged folder computes what the float base plus the exported adapter does."""
    pytest.importorskip("qwix")
    if "quantize" not in {f.name for f in dataclasses.fields(LoraTuning)}:
        pytest.skip("LoraTuning has no quantize setting (QLoRA) in this tree")
    experiment = from_pretrained(
        folder, "gpt_char", data=str(write_corpus(tmp_path)),
        train=dict(SHORT, steps=2, eval_every=2, checkpoint_every=2),
        optim={"learning_rate": 1e-2, "warmup_steps": 1},
        peft=LoraTuning(rank=4, targets=("query", "value"), quantize="int8"))
    train(experiment, tmp_path / "qlora", progress=False)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        export_run(tmp_path / "qlora", tmp_path / "merged", merged=True),
        attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base, export_run(tmp_path / "qlora",
                                                              tmp_path / "adapter"))
    np.testing.assert_allclose(_logits(merged.eval()), _logits(adapted.eval()), rtol=1e-4,
                               atol=1e-4)


def test_byte_level_run_from_scratch(tmp_path):
    """A full run of the default experiment: LLaMA expresses its decoder; no tokenizer."""
    experiment = tiny("gpt_char", write_corpus(tmp_path), steps=2, eval_every=2,
                      checkpoint_every=2)
    train(experiment, tmp_path / "run", progress=False)
    with pytest.warns(UserWarning, match="without a tokenizer: .* byte-level"):
        to = export_run(tmp_path / "run", tmp_path / "hf")
    assert {p.name for p in to.iterdir()} == {"config.json", "model.safetensors"}
    model = transformers.AutoModelForCausalLM.from_pretrained(to, attn_implementation="eager")
    assert type(model).__name__ == "LlamaForCausalLM"
    np.testing.assert_allclose(_tfx_logits(tmp_path / "run"), _logits(model.eval()),
                               rtol=1e-4, atol=1e-4)


def test_architecture_of_a_model_trained_from_scratch():
    assert hf_architecture(PRESETS["char-gpt"]) == "LlamaForCausalLM"
    assert hf_architecture(PRESETS["char-moe"]) == "MixtralForCausalLM"
    assert hf_architecture(PRESETS["gpt2-small"]) == "GPT2LMHeadModel"
    with pytest.raises(ValueError, match=r"model: no Hugging Face architecture.*'alibi'"):
        hf_architecture(PRESETS["char-gpt"].replace(position="alibi"))


def test_a_multimodal_base_exports_as_its_text_architecture(tmp_path):
    # tfx.hf.load reads the text model of a multimodal checkpoint; the export is that model.
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    assert export._base_architecture(tmp_path) == "Qwen3_5ForCausalLM"
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2_5_VLForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="none of which tfx saves"):
        export._base_architecture(tmp_path)


def _stored_run(workdir, experiment):
    """A workdir holding only a run's config (enough for everything export checks first)."""
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints" / "config.json").write_text(json.dumps(experiment.to_dict()))
    return workdir


def test_refusals_write_nothing(tmp_path):
    full = tiny("gpt_char")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    refused = {
        "not empty": (_stored_run(tmp_path / "full", full), taken, None),
        "no trained run": (tmp_path / "nothing", tmp_path / "out", None),
        "no checkpoint yet": (tmp_path / "full", tmp_path / "out", None),
        "every weight": (tmp_path / "full", tmp_path / "out", False),
        r"peft.method='prompt'": (_stored_run(tmp_path / "prompt", dataclasses.replace(
            full, peft=PromptTuning(num_tokens=2))), tmp_path / "out", None),
        "needs the Hugging Face folder": (_stored_run(tmp_path / "lora", dataclasses.replace(
            full, peft=LoraTuning(rank=2))), tmp_path / "out", False),
        "tokenizer .* is gone": (_stored_run(tmp_path / "gone", dataclasses.replace(
            full, data=dataclasses.replace(full.data, tokenizer=str(tmp_path / "tok.json")))),
            tmp_path / "out", None),
    }
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for message, (workdir, to, merged) in refused.items():
        with pytest.raises(ValueError, match=message):
            export_run(workdir, to, merged=merged)
    assert main(["export", "--workdir", str(tmp_path / "full"), "--to", str(taken)]) == 2
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (taken / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="--to"):
        export_run(tmp_path / "full", "")
    with pytest.raises(ValueError, match=r"--to .* not a folder"):
        export_run(tmp_path / "full", taken / "keep.txt")


def test_a_failing_write_leaves_no_folder(lora_run, tmp_path, monkeypatch):
    def half_written(model, folder, **_):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "save_peft_adapter", half_written)
    with pytest.raises(RuntimeError, match="disk full"):
        export_run(lora_run, tmp_path / "adapter")
    assert list(tmp_path.iterdir()) == []
