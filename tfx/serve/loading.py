"""What `tfx serve` serves: a model (with its LoRA adapters), its tokenizer, and their names."""

from __future__ import annotations

import dataclasses
import pathlib

from flax import nnx

__all__ = ["Served", "load_served", "parse_adapters"]


@dataclasses.dataclass(frozen=True)
class Served:
    """A model ready for the engine.

    model: a decoder; with adapters it holds them all (`tfx.peft.multi_lora`), adapter i
      (in `adapters` order) being the engine's variant i + 1.
    tokenizer: `tfx.train.data.Tokenizer` (a `ChatTokenizer` when the folder has a chat
      template). name: the base model's id in /v1/models. adapters: the adapters' ids.
    eos: ids that end a completion (the checkpoint's EOS); the chat end of turn is the
      tokenizer's eos.
    """

    model: nnx.Module
    tokenizer: object
    name: str
    adapters: tuple[str, ...] = ()
    eos: tuple[int, ...] = ()

    def variant(self, model_id: str) -> int | None:
        """The engine variant of a request's `model` field (None: no such model)."""
        if model_id == self.name:
            return 0
        return self.adapters.index(model_id) + 1 if model_id in self.adapters else None


def parse_adapters(specs) -> dict[str, str]:
    """["NAME=DIR", ...] -> {NAME: DIR}, refusing a malformed or repeated name."""
    adapters = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--adapter must be NAME=DIR, got {spec!r}")
        if name in adapters:
            raise ValueError(f"--adapter names {name!r} twice")
        adapters[name] = folder
    return adapters


def load_served(path: str | pathlib.Path, adapters: dict[str, str] | None = None, *,
                name: str | None = None, max_len: int | None = None) -> Served:
    """Load a tfx run or a Hugging Face folder, and the LoRA adapters named {id: folder}
    (peft adapter folders, as `tfx export` writes them, or tfx LoRA runs).

    max_len: the longest sequence (prompt + new tokens) served; default the model's."""
    from tfx.peft.multi_lora import attach_many
    from tfx.train.sampling import load_model, with_cache_length

    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"PATH must be a tfx run or a Hugging Face folder, got {str(path)!r}")
    model, tokenizer, _ = load_model(path)
    name = name or path.resolve().name
    adapters = dict(adapters or {})
    if name in adapters:
        raise ValueError(f"adapter {name!r} has the base model's name (choose another, or "
                         "set --name)")
    if adapters:
        attach_many(model, {key: _adapter(folder, model) for key, folder in adapters.items()})
    if max_len is not None:
        model = with_cache_length(model, max_len, max_len)
    return Served(model, tokenizer, name, tuple(adapters), _eos(model, tokenizer))


def _adapter(folder: str, model):
    """The LoRA factors in `folder`: a peft adapter folder or a tfx LoRA run."""
    from tfx import hf
    from tfx.peft import lora

    folder = pathlib.Path(folder)
    if (folder / "adapter_config.json").is_file():
        return hf.load_peft_adapter(folder, model)
    if (folder / "checkpoints" / "config.json").is_file():
        from tfx.train.run import load_run

        return lora.weights_of(load_run(folder).model)
    raise ValueError(f"--adapter folder {str(folder)!r} is neither a peft adapter folder "
                     "(adapter_config.json) nor a tfx LoRA run (checkpoints/config.json)")


def _eos(model, tokenizer) -> tuple[int, ...]:
    """The checkpoint's EOS ids: those of the model's generation config (what `tfx.hf.load`
    reads from generation_config.json, else config.json, and `tfx.generate` stops at), else
    the tokenizer's."""
    from tfx.generation.config import generation_config_of

    eos = generation_config_of(model).eos_token_id
    if eos:
        return eos
    eos = getattr(tokenizer, "eos_id", None)
    return () if eos is None else (eos,)
