"""What `TfxLM.from_path` reads: a tfx run's workdir or a Hugging Face folder, as a model, its
tokenizer and the special tokens lm-eval's hf backend would use for it (no lm-eval import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from flax import nnx

from tfx.generation.config import generation_config_of
from tfx.train.data import Tokenizer, load_tokenizer

__all__ = ["Loaded", "load"]


class Loaded(NamedTuple):
    """A model ready to evaluate. bos_id: the tokenizer's BOS (None: it has none);
    eos_ids: the ids that end generation, the tokenizer's EOS first (empty: none);
    add_bos_token: whether encoding a text starts with BOS (the tokenizer's own default)."""

    model: nnx.Module
    tokenizer: Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos_token: bool


def load(path: str | Path, *, dtype: str | None = None) -> Loaded:
    """A run workdir (checkpoints/config.json: `tfx.train.load_run`, newest step) or a
    transformers folder (config.json + safetensors: `tfx.hf.load`, and its tokenizer with the
    special tokens of tokenizer_config.json (`tfx.train.chat.ChatTokenizer`) and the EOS ids
    of its generation config (`model.generation_config`, read from generation_config.json /
    config.json), where `tfx.generate` stops. A run's tokenizer has special tokens when it is
    a transformers tokenizer folder; a byte tokenizer or a bare tokenizer.json has none.

    Raises:
      ValueError: naming `path` when it is neither; naming `dtype` for a run (it loads in its
        training dtype).
    """
    folder = Path(path)
    if (folder / "checkpoints" / "config.json").is_file():
        from tfx.train.run import load_run

        if dtype is not None:
            raise ValueError(f"dtype: a run loads in its training dtype, got dtype={dtype!r}")
        run = load_run(folder)
        model, tokenizer, generation = run.model, run.tokenizer, []
    elif (folder / "config.json").is_file():
        import tfx.hf

        model, tokenizer = tfx.hf.load(folder, dtype=dtype), load_tokenizer(folder)
        generation = list(generation_config_of(model).eos_token_id)  # as tfx.generate stops
    else:
        raise ValueError(f"path {str(path)!r} is neither a tfx run (no checkpoints/config.json) "
                         "nor a Hugging Face folder (no config.json)")
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    eos_ids = tuple(dict.fromkeys(([] if eos is None else [eos]) + generation))
    return Loaded(model, tokenizer, bos, eos_ids, _adds_bos(tokenizer, bos))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _adds_bos(tokenizer, bos: int | None) -> bool:
    """Whether transformers' tokenizer starts an encoded text with BOS: tokenizer_config.json's
    add_bos_token when it says, else what tokenizer.json's post-processor adds."""
    folder = getattr(tokenizer, "folder", None)  # a transformers tokenizer folder's
    if bos is None or folder is None:
        return False
    config = _read_json(folder / "tokenizer_config.json")
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(tokenizer.path))
    plain = raw.encode("a", add_special_tokens=False).ids
    special = raw.encode("a", add_special_tokens=True).ids
    return special[:1] == [bos] and plain[:1] != [bos]
