"""`GenerationConfig`: the decoding defaults a model carries, transformers' generation config.

`tfx.hf.load` reads a checkpoint's `generation_config.json` (without one, the same fields of its
config.json, as transformers' `GenerationConfig.from_model_config` does) into
`model.generation_config`, a static attribute that survives `nnx.split` / `nnx.merge` and
`nnx.jit`; `tfx.hf.save` writes it back. Any tfx model may be given one:
`model.generation_config = GenerationConfig(eos_token_id=2)`.

`tfx.generate`, `tfx.beam_search` and `tfx.speculative_generate` take every argument a call
leaves unset (None) from it, so that a checkpoint decodes as transformers' `generate` decodes
it: greedy unless the config says do_sample, stopping at the config's EOS ids, filling finished
rows with its pad id. The caller's explicit values win. A model without one decodes with
`GenerationConfig()`: greedy, no EOS.

Imports no jax: a config can be read and checked before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

from tfx.generation._numbers import integer, real

__all__ = ["GenerationConfig", "generation_config_of"]

# transformers' defaults for the fields tfx reads (GenerationConfig._get_default_generation_params),
# which `from_hf` fills in for those a file leaves out. Not transformers' max_length=20: without
# max_new_tokens or max_length in the file, tfx asks the caller for max_new_tokens.
_HF_DEFAULTS = {"eos_token_id": None, "pad_token_id": None, "bos_token_id": None,
                "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "max_new_tokens": None,
                "max_length": None, "length_penalty": 1.0, "early_stopping": False}
# transformers' values that switch a filter or processor off, and tfx's (None).
_OFF = {"top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
# The numeric fields' checks (None is always allowed), each returning the value.
_CHECKS = {
    "pad_token_id": lambda name, value: integer(name, value, minimum=0),
    "bos_token_id": lambda name, value: integer(name, value, minimum=0),
    "temperature": lambda name, value: real(name, value, low=0.0),
    "top_k": integer,
    "top_p": lambda name, value: real(name, value, low=0.0, high=1.0, open_low=True),
    "repetition_penalty": lambda name, value: real(name, value, low=0.0, open_low=True),
    "no_repeat_ngram_size": integer, "max_new_tokens": integer, "max_length": integer,
    "length_penalty": real,
}


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What decoding does when a call does not say (transformers' names and meanings).

    eos_token_id: ids that end a sequence (an int or a sequence of ints, kept as a tuple;
      () none).
    pad_token_id: filler after EOS, or None (the model config's pad id, else the first EOS id).
    bos_token_id: kept for saving (tfx decodes the prompt as given and adds no BOS).
    do_sample: False: greedy decoding; True: sampling at `temperature`, with top_k / top_p.
    temperature: >= 0, used when do_sample (0 decodes greedily).
    top_k: int >= 1, or None (off). top_p: in (0, 1], or None (off).
    repetition_penalty: > 0, or None (off). no_repeat_ngram_size: int >= 1, or None (off).
    max_new_tokens: int >= 1 or None; else max_length: int >= 1 (prompt included, as in
      transformers) or None. With neither, a call must give max_new_tokens.
    length_penalty, early_stopping: beam search's (`tfx.beam_search`).
    Raises:
      ValueError: naming the field, for a value out of range or of the wrong type.
    """

    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    max_new_tokens: int | None = None
    max_length: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self):
        eos = self.eos_token_id
        eos = (eos,) if isinstance(eos, numbers.Number) else eos
        if isinstance(eos, str | bytes) or not isinstance(eos, tuple | list):
            raise ValueError(f"generation_config.eos_token_id must be a token id or a list of "
                             f"them, got {self.eos_token_id!r}")
        object.__setattr__(self, "eos_token_id", tuple(
            integer("generation_config.eos_token_id", i, minimum=0) for i in eos))
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"generation_config.do_sample must be true or false, got "
                             f"{self.do_sample!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"generation_config.early_stopping must be true, false or "
                             f"'never', got {self.early_stopping!r}")
        for field, check in _CHECKS.items():  # stored as Python ints and floats
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, check(f"generation_config.{field}", value))

    @classmethod
    def from_hf(cls, fields: Mapping, source: str) -> GenerationConfig:
        """A transformers generation config (generation_config.json, or the config.json of a
        checkpoint without one) over transformers' defaults for what it leaves out or sets to
        null (top_k 50); other keys are ignored. `source` names the file in errors."""
        given = {key: value for key, value in fields.items()
                 if key in _HF_DEFAULTS and value is not None}
        values = {**_HF_DEFAULTS, **given}
        values.update({key: None for key, off in _OFF.items() if values[key] == off})
        if values["eos_token_id"] is None:
            values["eos_token_id"] = ()
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def to_hf(self) -> dict:
        """The fields for generation_config.json that differ from transformers' defaults."""
        eos = self.eos_token_id
        values = {**dataclasses.asdict(self),
                  "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else list(eos),
                  **{key: off for key, off in _OFF.items() if getattr(self, key) is None}}
        return {key: value for key, value in values.items() if value != _HF_DEFAULTS[key]}

    def fill(self, **given) -> dict:
        """`given` (argument name -> value, None for unset), each unset value replaced by this
        config's field of that name."""
        return {name: getattr(self, name) if value is None else value
                for name, value in given.items()}

    def sampling(self, temperature, top_k, top_p) -> tuple:
        """(temperature, top_k, top_p), the unset (None) ones from this config: temperature is
        0.0 (greedy) unless do_sample."""
        if temperature is None:
            temperature = self.temperature if self.do_sample else 0.0
        return (temperature, self.top_k if top_k is None else top_k,
                self.top_p if top_p is None else top_p)

    def new_tokens(self, max_new_tokens, head: int):
        """The caller's max_new_tokens, else this config's, else max_length - head (the columns
        before the new tokens: a decoder's prompt width, an encoder–decoder's start token).

        Raises:
          ValueError: none of them is set, or max_length leaves no room after head.
        """
        if max_new_tokens is not None:
            return max_new_tokens
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            raise ValueError("max_new_tokens must be given (an int >= 1): the model's "
                             "generation_config sets neither max_new_tokens nor max_length")
        if self.max_length <= head:
            raise ValueError(f"max_new_tokens must be given: the model's generation_config "
                             f"max_length ({self.max_length}) leaves no room after the "
                             f"{head} prompt columns")
        return self.max_length - head


def generation_config_of(model) -> GenerationConfig:
    """`model.generation_config` (what `tfx.hf.load` attaches), else `GenerationConfig()`.

    Raises:
      TypeError: the attribute is something else (a transformers GenerationConfig, a dict).
    """
    config = getattr(model, "generation_config", None)
    if config is None:
        return GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"model.generation_config must be a tfx.generation.GenerationConfig "
                        f"(e.g. GenerationConfig.from_hf(hf_config.to_dict(), 'hf')), got "
                        f"{type(config).__name__}")
    return config
