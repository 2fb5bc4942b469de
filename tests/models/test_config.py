"""Model configs nested by concern: at most 20 top-level fields, sub-configs validated with
their dotted paths, present only when used, and changed through `replace` with dicts."""

from __future__ import annotations

import dataclasses

import pytest

from tfx.models import (
    PRESETS,
    AttentionConfig,
    DecoderConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    MoeConfig,
    NormConfig,
    RopeConfig,
    T5BiasConfig,
    create,
)
from tfx.models.config import field_value, nested

TINY = dict(vocab_size=32, d_model=16, num_layers=1, num_heads=2, d_ff=32)


@pytest.mark.parametrize("family", [DecoderConfig, EncoderConfig, EncoderDecoderConfig])
def test_no_family_has_more_than_20_top_level_fields(family):
    assert len(dataclasses.fields(family)) <= 20


def test_position_sub_configs_exist_only_for_their_position():
    rope = DecoderConfig(**TINY, position="rope")
    assert rope.rope == RopeConfig() and rope.t5 is None
    assert DecoderConfig(**TINY).rope is None  # learned positions: no RoPE settings
    t5 = EncoderDecoderConfig(**TINY, position="t5")
    assert t5.t5 == T5BiasConfig() and t5.rope is None
    with pytest.raises(ValueError, match=r"rope holds the settings of position='rope', but "
                                         r"position is 'alibi'"):
        DecoderConfig(**TINY, position="alibi", rope=RopeConfig())


def test_replace_takes_dicts_for_sub_configs_and_drops_unused_position_settings():
    config = PRESETS["char-gpt"]
    changed = config.replace(moe={"num_experts": 4}, norm={"eps": 1e-5}, d_model=128)
    assert changed.moe == MoeConfig(num_experts=4)  # from MoeConfig's defaults: it was None
    assert changed.norm == NormConfig(kind="rms", eps=1e-5)  # kind kept, eps changed
    assert changed.d_model == 128
    assert changed.replace(moe={"d_ff": 8}).moe == MoeConfig(num_experts=4, d_ff=8)
    assert changed.replace(moe=None).moe is None
    learned = config.replace(position="learned")
    assert learned.rope is None
    assert learned.replace(position="rope").rope == RopeConfig()
    assert config.replace(rope={"theta": 5e5}).rope.theta == 5e5
    with pytest.raises(TypeError, match="max_len is not a sub-config"):
        config.replace(max_len={"value": 3})


def test_create_takes_nested_changes():
    model = create("char-gpt", num_layers=1, attention={"num_kv_heads": 1},
                   moe={"num_experts": 2, "d_ff": 16})
    assert model.config.kv_heads == 1 and model.config.moe.num_experts == 2
    assert model.config.attention == AttentionConfig(num_kv_heads=1)


@pytest.mark.parametrize("changes, error, match", [
    (dict(moe={"num_experts": 0}), ValueError, r"^moe\.num_experts must be >= 1, got 0$"),
    (dict(moe={"experts_per_token": 9}), ValueError,
     r"^moe\.experts_per_token \(9\) must be <= moe\.num_experts \(8\)$"),
    (dict(rope={"theta": 0.0}), ValueError, r"^rope\.theta must be > 0"),
    (dict(attention={"head_dim": 0}), ValueError, r"^attention\.head_dim must be >= 1"),
    (dict(norm={"pre_norm": "yes"}), TypeError, r"^norm\.pre_norm must be a bool"),
    (dict(mlp={"gated": 1}), TypeError, r"^mlp\.gated must be a bool"),
    (dict(compute={"param_dtype": "int8"}), ValueError, r"^compute\.param_dtype must be one of"),
    (dict(attention=AttentionConfig), TypeError, r"^attention must be an? AttentionConfig"),
])
def test_sub_configs_name_the_field_by_its_dotted_path(changes, error, match):
    with pytest.raises(error, match=match):
        PRESETS["char-gpt"].replace(**changes)


def test_t5_settings_are_validated_and_decoder_only_attention_is_refused():
    with pytest.raises(ValueError, match=r"t5\.num_buckets must be >= 1"):
        EncoderDecoderConfig(**TINY, position="t5", t5={"num_buckets": 0})
    with pytest.raises(ValueError, match=r"attention\.sliding_window is for causal decoders"):
        EncoderDecoderConfig(**TINY, attention={"sliding_window": 4})
    with pytest.raises(ValueError, match=r"attention\.pattern is for causal decoders"):
        EncoderConfig(**TINY, attention={"pattern": "window:4"})
    with pytest.raises(ValueError, match=r"special_tokens\.cls_id must be >= 0"):
        EncoderConfig(**TINY, special_tokens={"cls_id": -1})


def test_nested_and_field_value_read_dotted_names():
    kwargs = nested({"d_model": 16, "norm.kind": "rms", "norm.eps": 1e-6, "moe.num_experts": 2})
    assert kwargs == {"d_model": 16, "norm": NormConfig(kind="rms", eps=1e-6),
                      "moe": MoeConfig(num_experts=2)}
    config = DecoderConfig(**{**TINY, **kwargs})
    assert field_value(config, "norm.eps") == 1e-6 and field_value(config, "rope.theta") is None
    with pytest.raises(ValueError, match="'mixer' is not a sub-config"):
        nested({"mixer.width": 3})
