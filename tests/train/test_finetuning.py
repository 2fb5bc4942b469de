"""Fine-tuning configs (tfx.train.finetuning): one dataclass per method, holding only its own
settings, each building (and so validating) its tfx.peft method object."""

from __future__ import annotations

import pytest

from tfx import peft
from tfx.train.finetuning import (
    METHODS,
    AdapterTuning,
    FullTuning,
    LoraTuning,
    PrefixTuning,
    PromptTuning,
    peft_config,
)


def test_each_method_builds_its_peft_object_with_its_settings():
    assert FullTuning().settings() is None
    assert LoraTuning(rank=2, targets=("query", "key")).settings() == peft.LoRA(
        rank=2, alpha=16.0, targets=("query", "key"))
    assert PromptTuning(num_tokens=3, init="random").settings() == peft.SoftPrompt(
        num_tokens=3, init="random")
    assert PrefixTuning(num_tokens=3, projection=8).settings() == peft.Prefix(
        num_tokens=3, projection=8)
    assert AdapterTuning(size=4, placement="pfeiffer").settings() == peft.Adapters(
        size=4, placement="pfeiffer")
    assert {name: kind.method for name, kind in METHODS.items()} == {
        name: name for name in ("full", "lora", "prompt", "prefix", "adapter")}


def test_bad_settings_and_methods_are_refused_when_made():
    with pytest.raises(ValueError, match="rank"):
        LoraTuning(rank=0)
    with pytest.raises(ValueError, match="num_tokens"):
        PrefixTuning(num_tokens=0)
    with pytest.raises(TypeError):
        LoraTuning(size=4)  # another method's setting
    assert peft_config("adapter", size=4) == AdapterTuning(size=4)
    with pytest.raises(ValueError, match=r"peft\.method must be one of \('full', 'lora'"):
        peft_config("ia3")
