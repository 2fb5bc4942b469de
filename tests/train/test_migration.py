"""Stored experiment configs of the flat layout (version 1, before the model configs were
nested by concern) and of version 2 (one PeftConfig for every fine-tuning method) migrate to the
current one (tfx.train.migration) and resume."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from tfx.models import MoeConfig, NormConfig, SpecialTokens
from tfx.train.checkpoint import Checkpoints
from tfx.train.config import experiment_from_dict, run_identity, stored_identity
from tfx.train.experiments import get_experiment
from tfx.train.finetuning import (
    AdapterTuning,
    FullTuning,
    LoraTuning,
    PrefixTuning,
    PromptTuning,
)
from tfx.train.migration import CONFIG_VERSION, migrate

# The config.json that tfx wrote for `tfx train moe_gpt --model.load_balancing_weight=0.0`
# before the redesign (run_identity of version 1: no "version" key, a flat model).
V1_MOE_GPT = {
    "__type__": "Experiment", "name": "moe_gpt", "objective": "causal_lm",
    "model": {
        "__type__": "DecoderConfig", "vocab_size": 256, "d_model": 256, "num_layers": 4,
        "num_heads": 4, "d_ff": 1024, "num_kv_heads": 2, "head_dim": None, "max_len": 256,
        "position": "rope", "rope_theta": 10000.0, "rope_layout": "half", "rope_scaling": None,
        "rope_fraction": 1.0, "t5_num_buckets": 32, "t5_max_distance": 128,
        "activation": "silu", "gated_mlp": True, "norm": "rms", "norm_eps": 1e-06,
        "pre_norm": True, "use_bias": False, "attention_scale": None, "dropout": 0.0,
        "tie_embeddings": True, "implementation": None, "dtype": None,
        "param_dtype": "float32", "remat": False, "scan_layers": False, "num_experts": 8,
        "experts_per_token": 2, "moe_every": 1, "moe_d_ff": 512, "capacity_factor": None,
        "router_policy": "topk", "router_jitter": 0.0, "moe_dispatch": None,
        "moe_shared_experts": 0, "router_bias_rate": 0.001, "load_balancing_weight": 0.0,
        "router_z_weight": 0.001, "sliding_window": None},
    "train": {"__type__": "TrainConfig", "steps": 300, "batch_size": 16, "seq_len": 128,
              "grad_accum": 1, "seed": 0},
    "optim": {"__type__": "OptimConfig", "learning_rate": 0.002, "warmup_steps": 40,
              "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95, "grad_clip": 1.0},
    "data": {"__type__": "DataConfig", "source": None, "tokenizer": "byte",
             "val_fraction": 0.05, "task": None, "min_len": 4, "max_len": 16},
    "label_smoothing": 0.0, "mlm_probability": 0.15}

# bert_mlm's version-1 model: post-norm, special token ids, no experts (num_experts=0).
V1_BERT_MODEL = {
    "__type__": "EncoderConfig", "vocab_size": 260, "d_model": 256, "num_layers": 4,
    "num_heads": 4, "d_ff": 1024, "num_kv_heads": None, "head_dim": None, "max_len": 128,
    "position": "learned", "rope_theta": 10000.0, "rope_layout": "half", "rope_scaling": None,
    "rope_fraction": 1.0, "t5_num_buckets": 32, "t5_max_distance": 128, "activation": "gelu",
    "gated_mlp": False, "norm": "layer", "norm_eps": 1e-12, "pre_norm": False, "use_bias": True,
    "attention_scale": None, "dropout": 0.0, "tie_embeddings": True, "implementation": None,
    "dtype": None, "param_dtype": "float32", "remat": False, "scan_layers": False,
    "num_experts": 0, "experts_per_token": 2, "moe_every": 1, "moe_d_ff": None,
    "capacity_factor": None, "router_policy": "topk", "router_jitter": 0.0,
    "moe_dispatch": None, "moe_shared_experts": 0, "router_bias_rate": 0.001,
    "load_balancing_weight": 0.01, "router_z_weight": 0.001, "type_vocab_size": 2,
    "pad_token_id": 256, "cls_token_id": 257, "sep_token_id": 258, "mask_token_id": 259}


def _moe_gpt_without_balancing():
    e = get_experiment("moe_gpt")
    return dataclasses.replace(e, train=dataclasses.replace(e.train, load_balancing_weight=0.0))


def test_a_flat_moe_run_migrates_to_nested_model_and_training_weights():
    stored = copy.deepcopy(V1_MOE_GPT)
    migrated = migrate(stored)
    assert stored == V1_MOE_GPT  # the input is left alone
    assert migrated["version"] == CONFIG_VERSION == 3
    assert migrated["model"]["moe"] == {"__type__": "MoeConfig", "num_experts": 8,
                                        "experts_per_token": 2, "every": 1, "d_ff": 512,
                                        "capacity_factor": None, "policy": "topk",
                                        "jitter": 0.0, "dispatch": None, "shared_experts": 0}
    assert migrated["train"]["load_balancing_weight"] == 0.0
    assert "load_balancing_weight" not in migrated["model"]
    experiment = experiment_from_dict(V1_MOE_GPT)  # a stored identity: no loop settings
    assert experiment.model == get_experiment("moe_gpt").model
    assert experiment.model.moe == MoeConfig(num_experts=8, d_ff=512)
    assert experiment.train.load_balancing_weight == 0.0


def test_a_flat_dense_encoder_migrates_without_experts_or_unused_positions():
    stored = {"__type__": "Experiment", "name": "x", "objective": "mlm", "model": V1_BERT_MODEL,
              "train": {"__type__": "TrainConfig", "seq_len": 128}}
    model = experiment_from_dict(stored).model
    assert model == get_experiment("bert_mlm").model
    assert model.moe is None and model.rope is None and model.t5 is None
    assert model.norm == NormConfig(kind="layer", eps=1e-12, pre_norm=False)
    assert model.special_tokens == SpecialTokens(pad_id=256, cls_id=257, sep_id=258, mask_id=259)


def test_a_run_stored_in_the_flat_layout_resumes(tmp_path):
    """The workdir's config.json of version 1 matches the same run's current identity (the
    check a resuming Trainer makes), and still refuses another run."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(V1_MOE_GPT))
    same = run_identity(_moe_gpt_without_balancing())
    assert stored_identity(V1_MOE_GPT) == json.loads(json.dumps(same))
    with Checkpoints(folder, config=same, read_only=True, stored_form=stored_identity):
        pass
    other = run_identity(get_experiment("moe_gpt"))  # load_balancing_weight 0.01
    with pytest.raises(ValueError, match=r"train\.load_balancing_weight: 0\.0 vs 0\.01"):
        Checkpoints(folder, config=other, read_only=True, stored_form=stored_identity)


def test_a_config_of_a_newer_version_is_refused_with_what_to_do(tmp_path):
    newer = {**run_identity(get_experiment("gpt_char")), "version": CONFIG_VERSION + 1}
    with pytest.raises(ValueError, match="written by a newer tfx; upgrade tfx"):
        experiment_from_dict(newer)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(newer))
    with pytest.raises(ValueError, match=r"cannot read .* train in a new workdir"):
        Checkpoints(folder, config=run_identity(get_experiment("gpt_char")), read_only=True,
                    stored_form=stored_identity)


def test_current_runs_store_their_version():
    e = get_experiment("gpt_char")
    assert run_identity(e)["version"] == e.to_dict()["version"] == CONFIG_VERSION
    assert migrate(e.to_dict()) == e.to_dict()


# Version 2 stored fine-tuning as one PeftConfig with a method string and every method's fields.
V2_PEFT = {"__type__": "PeftConfig", "method": "full", "rank": 8, "alpha": 16.0,
           "targets": ["query", "value"], "init_style": "peft", "rslora": False,
           "num_tokens": 16, "prompt_init": "vocab", "prefix_projection": 0, "adapter_size": 16,
           "adapter_placement": "houlsby"}


@pytest.mark.parametrize("method,expected", [
    ("full", FullTuning()),
    ("lora", LoraTuning(rank=2, targets=("query", "key"))),
    ("prompt", PromptTuning(num_tokens=3, init="random")),
    ("prefix", PrefixTuning(num_tokens=3, projection=8)),
    ("adapter", AdapterTuning(size=4, placement="pfeiffer")),
])
def test_a_version_2_fine_tuning_config_becomes_its_methods_dataclass(method, expected):
    peft = {**V2_PEFT, "method": method, "rank": 2, "targets": ["query", "key"],
            "num_tokens": 3, "prompt_init": "random", "prefix_projection": 8, "adapter_size": 4,
            "adapter_placement": "pfeiffer"}
    stored = {**run_identity(get_experiment("gpt_char")), "version": 2, "peft": peft}
    experiment = experiment_from_dict(stored)
    assert experiment.peft == expected
    # The identity of a resumed version-2 run is that of the same run made now.
    current = dataclasses.replace(get_experiment("gpt_char"), peft=expected)
    assert stored_identity(stored) == run_identity(current)


def test_an_unknown_version_2_method_is_refused():
    stored = {**run_identity(get_experiment("gpt_char")), "version": 2,
              "peft": {**V2_PEFT, "method": "ia3"}}
    with pytest.raises(ValueError, match=r"peft\.method must be one of"):
        migrate(stored)
