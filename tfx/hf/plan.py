"""Conversion plans: how a family turns checkpoint tensors into tfx parameters, as a list of
steps whose inputs (HF tensor names) and outputs (tfx parameter paths) are known before any
tensor is read, so that a checkpoint is checked against the model from its headers alone.

`check` is the strictness of `tfx.hf.load`: tensors the model needs that the checkpoint lacks,
tensors the checkpoint has that the model has no place for (beyond the harmless buffers a
family lists, those transformers ignores too), and weights of dtypes other than float16 /
bfloat16 / float32 are errors naming them; with `strict=False` the first two warn instead.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tfx.hf.io import Checkpoint

__all__ = ["FLOAT_DTYPES", "Step", "check", "convert", "copy", "renamed", "run", "tied"]

Path = tuple[str | int, ...]
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_FEW = 5  # names quoted in a message; the count gives the rest
_NEEDED = "the model the config describes needs it"


@dataclasses.dataclass(frozen=True)
class Step:
    """One piece of a conversion: `convert(*arrays of sources)` gives the values of `targets`
    (a tuple of arrays, one per target; none for a step that only checks).

    Attributes:
      targets: tfx parameter paths, e.g. ("stack", "layers", 0, "mlp", "up", "kernel").
      sources: HF tensor names, e.g. "model.layers.0.mlp.up_proj.weight".
      convert: the function of the source arrays (numpy in, numpy out).
      why: why the sources are needed, for the error when one is missing.
      transpose: set by `copy` only (one source, one target: the tensor as it is, or
        transposed), which tells `tfx.hf.load` that it may do the step on the device (a
        transpose there is many times faster than numpy's); None for any other step, whose
        `convert` runs on the host.
    """

    targets: tuple[Path, ...]
    sources: tuple[str, ...]
    convert: Callable[..., Sequence[np.ndarray]]
    why: str = _NEEDED
    transpose: bool | None = None


def copy(path: Path, name: str, *, transpose: bool = False, why: str = _NEEDED) -> Step:
    """Parameter `path` is tensor `name`, transposed for a torch nn.Linear weight ([out, in])
    going to an nnx kernel ([in, out])."""
    return Step((path,), (name,), _transposed if transpose else _same, why, transpose)


def tied(copy_name: str, source: str, why: str = "") -> Step:
    """A tensor the config ties to `source` (e.g. lm_head.weight to the token embeddings): read
    only to check that it equals `source`, so a checkpoint that unties them is not misread."""
    return Step((), (copy_name, source), functools.partial(_check_tied, copy_name, source, why),
                f"the checkpoint's {copy_name} is tied to it")


def renamed(steps: Sequence[Step], name: Callable[[str], str]) -> list[Step]:
    """The same steps reading each source tensor `n` as `name(n)` (its name in another layout
    of the checkpoint, e.g. the text model's tensors inside a multimodal one); a `tied` check
    names the renamed tensors in its error."""
    out = []
    for step in steps:
        sources = tuple(map(name, step.sources))
        check = step.convert
        if isinstance(check, functools.partial) and check.func is _check_tied:
            out.append(tied(*sources, check.args[2]))
        else:
            out.append(dataclasses.replace(step, sources=sources))
    return out


def _same(value: np.ndarray) -> tuple[np.ndarray]:
    return (value,)


def _transposed(value: np.ndarray) -> tuple[np.ndarray]:
    return (value.T,)


def _check_tied(copy_name: str, source: str, why: str, copied, original) -> tuple[()]:
    if not np.array_equal(copied, original):
        raise ValueError(f"checkpoint tensor {copy_name} differs from {source}, which the "
                         f"config ties it to{f' ({why})' if why else ''}")
    return ()


def check(steps: list[Step], tensors: Mapping[str, np.ndarray], *, ignored: Sequence[str] = (),
          strict: bool = True, source: str = "checkpoint") -> tuple[list[Step], list[Path]]:
    """Check `tensors` against the plan before reading any data (for a `Checkpoint`).

    Args:
      steps: the family's plan.
      tensors: HF tensors by name (a `Checkpoint`, or a dict of arrays).
      ignored: regular expressions (full match) of harmless tensors that are not weights
        (buffers older transformers saved); they are neither read nor reported.
      strict: missing and unexpected tensors raise ValueError; False: they warn, unexpected
        tensors are not read and the steps that lack a tensor are left out.
      source: the checkpoint's name in messages (its folder).
    Returns:
      (steps to run, target paths of the steps left out: those keep the model's values).
    Raises:
      ValueError: naming the tensors (a few, and the count): a needed tensor of a dtype
        other than FLOAT_DTYPES (always), missing or unexpected tensors (when strict).
    """
    needed = list(dict.fromkeys(name for step in steps for name in step.sources))
    _check_dtypes([name for name in needed if name in tensors], tensors, source)
    missing = [name for name in needed if name not in tensors]
    harmless = re.compile("|".join(f"(?:{pattern})" for pattern in ignored) or "(?!)")
    unexpected = sorted(set(tensors) - set(needed) - {n for n in tensors if harmless.fullmatch(n)})
    problems = [*_missing(missing, steps), *_unexpected(unexpected)]
    if problems and strict:
        raise ValueError(f"{source}: " + "; ".join(problems) + " (tfx.hf.load(path, strict=False)"
                         " loads it anyway, warning)")
    if problems:
        warnings.warn(f"{source}: " + "; ".join(problems) + " (loaded with strict=False: "
                      "unexpected tensors are ignored, missing ones keep the model's initial "
                      "values)", stacklevel=3)
    absent = set(missing)
    kept = [step for step in steps if absent.isdisjoint(step.sources)]
    left_out = [path for step in steps if not absent.isdisjoint(step.sources)
                for path in step.targets]
    return kept, left_out


def _check_dtypes(names: list[str], tensors: Mapping[str, np.ndarray], source: str) -> None:
    def dtype(name: str) -> str:
        if isinstance(tensors, Checkpoint):
            return tensors.dtypes[name]  # from the header: nothing is read
        return np.asarray(tensors[name]).dtype.name

    wrong = [(name, dtype(name)) for name in names if dtype(name) not in FLOAT_DTYPES]
    if wrong:
        quoted = ", ".join(f"{name} ({kind})" for name, kind in wrong[:_FEW])
        raise ValueError(f"{source}: weights of dtypes tfx does not load: {quoted}"
                         f"{', ...' if len(wrong) > _FEW else ''} ({len(wrong)} in all); tfx "
                         f"loads {', '.join(FLOAT_DTYPES)} weights, and quantized checkpoints "
                         "are not supported")


def _missing(missing: list[str], steps: list[Step]) -> list[str]:
    if not missing:
        return []
    why = next(step.why for step in steps if missing[0] in step.sources)
    message = (f"{len(missing)} tensor(s) the model needs are missing: "
               f"tensor {missing[0]} is missing ({why})")
    if len(missing) > 1:
        message += f", and so are {missing[1:_FEW]}{' ...' if len(missing) > _FEW else ''}"
    return [message]


def _unexpected(unexpected: list[str]) -> list[str]:
    if not unexpected:
        return []
    return [f"unexpected tensors {unexpected[:_FEW]}{' ...' if len(unexpected) > _FEW else ''} "
            f"({len(unexpected)} in all) have no place in the model the config describes"]


def run(steps: list[Step], tensors: Mapping[str, np.ndarray]) -> dict[Path, np.ndarray]:
    """The parameters the steps make, by path, reading each source tensor when its step runs."""
    params: dict[Path, np.ndarray] = {}
    for step in steps:
        values = step.convert(*(tensors[name] for name in step.sources))
        params.update(zip(step.targets, values, strict=True))
    return params


def convert(steps: list[Step], tensors: Mapping[str, np.ndarray], *,
            ignored: Sequence[str] = ()) -> dict[Path, np.ndarray]:
    """`check` (strict) then `run`: what a family's `params_from_hf` is."""
    kept, _ = check(steps, tensors, ignored=ignored)
    return run(kept, tensors)
