"""Command-line overrides of an experiment's optional model sub-configs, before tyro reads them.

tyro overrides the fields of a default it is given; a sub-config that the default leaves out
(`moe` of a dense model, `rope` of a model with learned positions) has no fields to override.
`switch_parts` prepares the default so that these read as one would expect:

    --model.moe.num_experts=8     a dense model gets experts (MoeConfig's defaults, then 8)
    --model.moe=None              a model with experts becomes dense
    --model.position=rope         rotary positions with RopeConfig's defaults (as
                                  `TransformerConfig.replace(position=...)`: the settings of the
                                  old position kind, rope or t5, are dropped)
"""

from __future__ import annotations

import dataclasses

from tfx.models.config import OPTIONAL_SUBCONFIGS as _OPTIONAL
from tfx.models.config import SUBCONFIGS
from tfx.train.config import Experiment

__all__ = ["switch_parts"]


def switch_parts(experiment: Experiment, args: list[str]) -> tuple[Experiment, list[str]]:
    """(experiment with the optional model sub-configs that `args` name switched on or off,
    the args left for tyro). args: command-line options, `--a.b=value` or `--a.b value`."""
    model, rest, changes = experiment.model, [], {}
    options = _options(args)
    for option, value, raw in options:
        path = option.split(".")
        if path == ["model", "position"]:
            model = model.replace(position=value)
        if len(path) == 2 and path[0] == "model" and path[1] in _OPTIONAL and value == "None":
            changes[path[1]] = None  # removes it: tyro has no spelling for None here
            continue
        named = len(path) > 2 and path[0] == "model" and path[1] in _OPTIONAL
        if named and getattr(model, path[1]) is None and path[1] not in changes:
            changes[path[1]] = SUBCONFIGS[path[1]]()
        rest += raw
    if changes:
        model = model.replace(**changes)
    return dataclasses.replace(experiment, model=model), rest


def _options(args: list[str]) -> list[tuple[str, str | None, list[str]]]:
    """(option name without "--", its value or None, the raw args) for each option."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            out.append(("", None, [arg]))
            continue
        name, eq, value = arg[2:].partition("=")
        raw = [arg]
        if not eq:
            value = None
            if i < len(args) and not args[i].startswith("--"):
                value = args[i]
                raw.append(args[i])
                i += 1
        out.append((name, value, raw))
    return out
