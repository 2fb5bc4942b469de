"""Fine-tuning a Hugging Face folder from the command line and from Python: `--init-from` takes
a transformers save_pretrained folder (model, tokenizer, chat template), the sft objective
trains only on the answers (packed or not), a refused run writes nothing, and the run samples,
evaluates on a held-out file and reloads. References: the transformers model itself (logits,
held-out loss) and the masked cross-entropy written out here."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from hf_folders import chat_model_folder  # noqa: E402

import tfx  # noqa: E402
from tfx.cli import main  # noqa: E402
from tfx.train.finetuning import LoraTuning  # noqa: E402
from tfx.train.losses import supervised  # noqa: E402
from tfx.train.packed_losses import packed_supervised  # noqa: E402
from tfx.train.pretrained import adopt_base, from_pretrained  # noqa: E402
from tfx.train.run import initial_model, load_run  # noqa: E402
from tfx.train.sft_feed import PackedSftFeed, SftFeed  # noqa: E402

QUESTIONS = [("What is two plus two?", "It is four."), ("Hello!", "Hello! How can I help?"),
             ("Who jumps over the dog?", "The quick brown fox."),
             ("Write add.", "def add(a, b):\n    return a + b")]
SHORT = ["--steps", "6", "--train.batch-size", "4", "--train.seq-len", "64", "--log-every", "2",
         "--train.eval-every", "6", "--train.eval-batches", "1", "--checkpoint-every", "6"]
LORA = ["--peft", "lora", "--peft.rank", "4"]
TARGETS = ["--peft.targets", "query", "key", "value", "out"]


def _chats(path, repeat: int = 4):
    lines = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for q, a in QUESTIONS * repeat]
    lines += [{"prompt": q + " ", "completion": a} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_model_folder(torch, transformers, tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return _chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


def _train_args(workdir, folder, chats, *more):
    return ["train", "sft", "--workdir", str(workdir), "--init-from", str(folder), "--data",
            str(chats), "--no-progress", *SHORT, *more]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, folder, chats):
    workdir = tmp_path_factory.mktemp("runs") / "lora"
    assert main(_train_args(workdir, folder, chats, *LORA, *TARGETS)) == 0
    return workdir


def test_adopt_base_takes_model_and_tokenizer_from_the_folder(folder, chats):
    experiment = from_pretrained(folder, "sft", data=str(chats), peft="lora")
    assert experiment.model == tfx.hf.folder_config(folder)
    assert experiment.data.tokenizer == experiment.train.init_from == str(folder.resolve())
    assert experiment.model.vocab_size == len(transformers.AutoTokenizer.from_pretrained(folder))
    assert adopt_base(experiment) == experiment  # idempotent: a stored run resumes as itself
    remat = adopt_base(dataclasses.replace(
        experiment, model=experiment.model.replace(compute={"remat": True})))
    assert remat.model.compute.remat and remat.model.d_model == experiment.model.d_model


def test_the_run_starts_from_the_folders_weights(folder, chats):
    experiment = from_pretrained(folder, "sft", data=str(chats), peft="lora")
    model, _ = initial_model(experiment)
    ids = np.arange(3, 40)[None]
    ours = np.asarray(model(jnp.asarray(ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def _naive_masked_loss(logits, tokens, mask):
    """Mean cross-entropy of tokens[:, 1:] where mask[:, 1:], written out."""
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    total = count = 0.0
    for b, t in zip(*np.nonzero(mask[:, 1:]), strict=True):
        total -= logp[b, t, tokens[b, t + 1]]
        count += 1
    return total, count


def test_sft_loss_counts_only_the_answers_and_packing_keeps_it(folder, chats):
    experiment = from_pretrained(folder, "sft", data=str(chats),
                                 train={"batch_size": 4, "seq_len": 64})
    model, _ = initial_model(experiment)
    feed = SftFeed(experiment)
    batch = feed.train(0)
    tokenizer = feed.tokenizer
    for row, mask in zip(batch["tokens"], batch["loss_mask"], strict=True):
        # exactly an answer (its end-of-turn token is special: decode drops it)
        assert tokenizer.decode(row[mask]).strip() in {a for _, a in QUESTIONS}
    total, count, _ = supervised(model, jax.tree.map(jnp.asarray, batch), None)
    logits = np.asarray(model(jnp.asarray(batch["tokens"][:, :-1])))
    expected = _naive_masked_loss(logits, batch["tokens"], batch["loss_mask"])
    np.testing.assert_allclose((float(total), float(count)), expected, rtol=1e-5)
    # Packed rows: the same examples, each a segment, give the same summed loss.
    packed = PackedSftFeed(dataclasses.replace(experiment, data=dataclasses.replace(
        experiment.data, packing=True)))
    rows = packed.rows["train"][0]
    assert rows.tokens.shape[0] < len(packed.train_examples)  # several examples per row
    everything = {"tokens": rows.tokens.astype(np.int32), "loss_mask": packed.rows["train"][1],
                  "segment_ids": rows.segment_ids.astype(np.int32),
                  "positions": rows.positions.astype(np.int32)}
    p_total, p_count, _ = packed_supervised(model, jax.tree.map(jnp.asarray, everything), None)
    # Each example scored alone, jitted: one compile per example length, where op-by-op
    # dispatch compiled every operation of the model again for each length (3x slower).
    score = nnx.jit(supervised)
    alone = [score(model, jax.tree.map(jnp.asarray, {
        "tokens": e.ids[None], "loss_mask": e.loss_mask[None]}), None)
        for e in packed.train_examples]
    np.testing.assert_allclose(float(p_total), sum(float(a[0]) for a in alone), rtol=1e-4)
    assert float(p_count) == sum(float(a[1]) for a in alone)


def test_lora_sft_from_the_command_line(lora_run, folder, capsys):
    run = load_run(lora_run)
    assert run.experiment.objective == "sft" and run.experiment.peft.rank == 4
    assert run.model.config == tfx.hf.folder_config(folder)
    # the base weights are the folder's, untouched; only LoRA factors were trained
    base = tfx.hf.load(folder)
    for ours, theirs in zip(jax.tree.leaves(nnx.state(run.model.embeddings)),
                            jax.tree.leaves(nnx.state(base.embeddings)), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    capsys.readouterr()
    assert main(["sample", "--workdir", str(lora_run), "--prompt", "What is two plus two?",
                 "--chat", "--max-new-tokens", "300", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() != ""  # 300 > max_len 256: the cache grew


def test_eval_data_equals_the_transformers_loss(folder, tmp_path, capsys):
    text = tmp_path / "heldout.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    assert main(["eval", "--workdir", str(folder), "--data", str(text), "--max-len", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    total = count = 0.0
    for start in range(0, len(ids) - 1, 32):  # windows of 33 tokens overlapping by one
        window = torch.tensor(ids[start:start + 33])[None]
        with torch.no_grad():
            logits = hf(window).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
        count += window.shape[1] - 1
    assert out["tokens"] == count
    np.testing.assert_allclose(out["loss"], float(total) / count, rtol=1e-5)
    np.testing.assert_allclose(out["perplexity"], math.exp(float(total) / count), rtol=1e-5)


def test_a_refused_run_writes_nothing_and_the_fix_then_runs(folder, chats, tmp_path, capsys):
    workdir = tmp_path / "w"
    status = main(_train_args(workdir, folder, chats, *LORA, "--peft.targets",
                              "nothing_matches"))
    assert status == 2 and "nothing_matches" in capsys.readouterr().err
    assert not (workdir / "checkpoints" / "config.json").exists()
    # The fix: lora_run's settings, whose compiled step JAX's persistent cache then holds.
    assert main(_train_args(workdir, folder, chats, *LORA, *TARGETS)) == 0


def test_a_base_of_another_model_is_refused_before_writing(folder, chats, tmp_path):
    experiment = from_pretrained(folder, "sft", data=str(chats))
    other = dataclasses.replace(experiment, model=experiment.model.replace(num_layers=1))
    trainer_dir = tmp_path / "other"
    with pytest.raises(ValueError, match=r"init_from: .* another model; .*num_layers"):
        tfx.train.Trainer(other, trainer_dir, lock=True)
    assert not trainer_dir.exists()


def test_python_api_in_a_few_lines(folder, chats, tmp_path):
    experiment = from_pretrained(folder, "sft", data=str(chats), peft=LoraTuning(rank=2),
                                 train={"steps": 2, "batch_size": 2, "seq_len": 64,
                                        "eval_every": 2, "eval_batches": 1})
    result = tfx.train.train(experiment, tmp_path / "py", progress=False)
    assert result.step == 2 and math.isfinite(result.validation["loss"])
    model = load_run(tmp_path / "py").model
    assert isinstance(nnx.state(model), nnx.State)


def test_qlora_and_lora_dropout_from_the_command_line(folder, chats, tmp_path):
    pytest.importorskip("qwix")
    from tfx.quant import QuantizedLinear

    workdir = tmp_path / "qlora"
    assert main(_train_args(workdir, folder, chats, "--steps", "2", "--peft", "lora",
                            "--peft.quantize", "nf4", "--peft.dropout", "0.1")) == 0
    run = load_run(workdir)
    assert run.experiment.peft.quantize == "nf4" and run.experiment.peft.dropout == 0.1
    quantized = [m for _, m in nnx.iter_graph(run.model) if isinstance(m, QuantizedLinear)]
    assert quantized  # the frozen base is 4-bit; its LoRA factors trained in float
    assert math.isfinite(json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
                         .get("loss", 0.0))


def _preferences(path):
    lines = [{"prompt": [{"role": "user", "content": q}],
              "chosen": [{"role": "assistant", "content": a}],
              "rejected": [{"role": "assistant", "content": "the lazy dog"}]}
             for q, a in QUESTIONS * 3]
    lines += [{"prompt": q + " ", "chosen": a, "rejected": "def"} for q, a in QUESTIONS]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("peft", [["--peft", "lora"], []], ids=["lora", "full"])
def test_dpo_from_the_command_line_logs_rewards(folder, tmp_path, peft):
    workdir = tmp_path / "dpo"
    args = ["train", "dpo", "--workdir", str(workdir), "--init-from", str(folder), "--data",
            str(_preferences(tmp_path / "prefs.jsonl")), "--no-progress", *SHORT, *peft]
    assert main(args) == 0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    first = records[0]
    # Policy = reference at step 1 (LoRA's b is zero; the full run's reference is its start).
    for name in ("rewards_chosen", "rewards_margin", "rewards_accuracy", "logps_chosen"):
        assert name in first and math.isfinite(first[name])
    assert any(r["split"] == "val" and "rewards_margin" in r for r in records)


def test_model_options_that_the_folder_fixes_are_refused(folder, chats, tmp_path, capsys):
    status = main(_train_args(tmp_path / "w", folder, chats, "--model.num-layers=1"))
    assert status == 2 and "model.num_layers cannot be set" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_a_lora_step_compiles_once(folder, chats, tmp_path):
    # The starting state is committed to the device as the step's outputs are; an
    # uncommitted one compiled the step again at step 2 (benchmarks/finetune.py found it).
    experiment = from_pretrained(folder, "sft", data=str(chats), peft="lora",
                                 train={"batch_size": 2, "seq_len": 64})
    trainer = tfx.train.Trainer(experiment, tmp_path / "w")
    try:
        for step in range(3):
            trainer.state, _ = trainer.train_step(trainer.state, trainer.train_batch(step))
        assert trainer.train_step._cache_size() == 1
    finally:
        trainer.close()
