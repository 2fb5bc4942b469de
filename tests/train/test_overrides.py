"""Command-line overrides of nested model configs, as `tfx train` reads them: tyro over the
experiment, with optional sub-configs switched on or off first (tfx.train.overrides)."""

from __future__ import annotations

import pytest
import tyro

from tfx.models import MoeConfig, RopeConfig
from tfx.train.experiments import get_experiment
from tfx.train.overrides import switch_parts


def _parse(name: str, args: list[str]):
    """The experiment `tfx train NAME ARGS` would run (the CLI's tyro call)."""
    experiment, rest = switch_parts(get_experiment(name), args)
    return tyro.cli(type(experiment), default=experiment, args=rest,
                    config=(tyro.conf.FlagConversionOff, tyro.conf.AvoidSubcommands))


def test_naming_a_moe_field_gives_a_dense_model_experts():
    e = _parse("gpt_char", ["--model.moe.num_experts=4", "--model.moe.d_ff", "32",
                            "--train.load_balancing_weight=0.0"])
    assert e.model.moe == MoeConfig(num_experts=4, d_ff=32)
    assert e.train.load_balancing_weight == 0.0
    assert e.model.replace(moe=None) == get_experiment("gpt_char").model


def test_moe_none_makes_a_model_dense():
    e = _parse("moe_gpt", ["--model.moe=None"])
    assert e.model == get_experiment("gpt_char").model


def test_nested_fields_override_and_position_changes_bring_their_settings():
    e = _parse("gpt_char", ["--model.norm.eps=1e-5", "--model.attention.num_kv_heads", "1",
                            "--model.compute.scan_layers=True"])
    assert (e.model.norm.eps, e.model.kv_heads, e.model.compute.scan_layers) == (1e-5, 1, True)
    learned = _parse("gpt_char", ["--model.position=learned"])
    assert learned.model.position == "learned" and learned.model.rope is None
    rope = _parse("posenc_learned", ["--model.position", "rope", "--model.rope.theta=500.0"])
    assert rope.model.rope == RopeConfig(theta=500.0)


def test_a_bad_nested_value_names_its_path(capsys):
    with pytest.raises(SystemExit):  # tyro reports the config's ValueError and exits
        _parse("moe_gpt", ["--model.moe.experts_per_token=9"])
    assert "moe.experts_per_token (9) must be" in " ".join(capsys.readouterr().err.split())
