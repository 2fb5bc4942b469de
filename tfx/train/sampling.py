"""What `tfx sample` and `tfx eval` need around a trained model: the model and tokenizer of a run
or a Hugging Face folder, a KV cache long enough for the request, and chat prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from tfx.train.data import Tokenizer

__all__ = ["chat_prompt", "closing_prompt", "load_model", "validation_opening",
           "with_cache_length"]

# The window of a Hugging Face model scored without a run's train.seq_len.
DEFAULT_SEQ_LEN = 1024


def load_model(path: str | Path) -> tuple[nnx.Module, Tokenizer, int]:
    """(model in eval mode, tokenizer, sequence length) of a tfx run's workdir (its
    train.seq_len) or of a Hugging Face folder (its tokenizer folder; min(max_len, 1024))."""
    from tfx.train.pretrained import is_hf_base

    if is_hf_base(path):
        from tfx import hf
        from tfx.train.data import load_tokenizer

        model = hf.load(path)
        return model, load_tokenizer(str(path)), min(model.config.max_len, DEFAULT_SEQ_LEN)
    from tfx.train.run import load_run

    run = load_run(path)
    return run.model, run.tokenizer, run.experiment.train.seq_len


def with_cache_length(model: nnx.Module, needed: int, max_len: int | None = None) -> nnx.Module:
    """`model` with config.max_len (the length of the KV cache `tfx.generate` makes) set to
    `max_len`, or by default raised to `needed` tokens (prompt + new tokens) when that is more.
    Only a learned position table fixes the length: it is never exceeded (ValueError).

    The parameters are shared, not copied (PEFT modules attached to the model stay)."""
    config = model.config
    length = max(config.max_len, needed) if max_len is None else max_len
    if length < needed:
        raise ValueError(f"--max-len ({length}) is shorter than the prompt plus "
                         f"--max-new-tokens ({needed} tokens)")
    if length == config.max_len:
        return model
    if config.position == "learned" and length > config.max_len:
        raise ValueError(f"{needed} tokens (prompt + --max-new-tokens) exceed the model's "
                         f"learned position table (max_len = {config.max_len})")
    longer = config.replace(max_len=length)
    copy = nnx.merge(*nnx.split(model))  # a new module tree over the same arrays
    for _, node in nnx.iter_graph(copy):
        if isinstance(node, nnx.Module) and getattr(node, "config", None) == config:
            node.config = longer  # max_len sizes no parameter without a learned table
    return copy


def chat_prompt(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, int | None]:
    """(ids int32 [n], end-of-turn id): `text` as one user message through the tokenizer's chat
    template, the assistant's turn opened (`tfx.train.chat.ChatTokenizer`)."""
    from tfx.train.chat import ChatTokenizer

    if not isinstance(tokenizer, ChatTokenizer):
        raise ValueError("--chat needs a run whose tokenizer is a transformers tokenizer "
                         "folder with a chat template (one started from a Hugging Face folder)")
    ids, _ = tokenizer.encode_chat([{"role": "user", "content": text}],
                                   add_generation_prompt=True)
    return np.asarray(ids, np.int32), tokenizer.eos_id


def closing_prompt(experiment) -> tuple[str, bool]:
    """(prompt, chat) of the sample `tfx train` prints at the end: train.sample_prompt when set,
    else taken from the data. For the JSONL objectives (sft, dpo) the first prompt of the data
    file, and chat when that prompt is a chat turn (a set train.sample_prompt is sent as one
    too); for text, the first line of the first validation text (`validation_opening`)."""
    chosen = experiment.train.sample_prompt
    if experiment.objective in ("sft", "dpo"):
        prompt, chat = _first_prompt(experiment.data.source)
        return (prompt if chosen is None else chosen), chat
    return (validation_opening(experiment) if chosen is None else chosen), False


def _first_prompt(source: str) -> tuple[str, bool]:
    """(the prompt of the first record of the JSONL file `source`, whether it is a chat)."""
    with open(source, encoding="utf-8") as file:
        first = json.loads(next(line for line in file if line.strip()))
    turns = first.get("messages", first.get("prompt"))
    if isinstance(turns, str):
        return turns, False
    return next(t["content"] for t in turns if t["role"] == "user"), True


def validation_opening(experiment, max_chars: int = 48) -> str:
    """The first non-blank line of the run's first validation text, with its line break, cut
    after its last space before `max_chars` characters when longer. The texts are read again
    (not tokenized); from a token-shard folder, the first tokens of its validation split are
    decoded."""
    from tfx.train import shards
    from tfx.train.data import corpus_texts, split_texts

    source = experiment.data.source
    if shards.is_shard_folder(source):
        from tfx.train.objectives import get_objective

        tokenizer = get_objective(experiment.objective).tokenizer(experiment)
        stream = shards.open_shards(source, tokenizer, "val")
        text = tokenizer.decode(stream.windows(np.zeros(1, np.int64), min(len(stream), 256))[0])
    else:
        _, validation = split_texts(corpus_texts(source), experiment.data.val_fraction)
        text = validation[0][1]
    line = next((line for line in text.splitlines(keepends=True) if line.strip()), text)
    if len(line) <= max_chars:
        return line
    cut = line.rfind(" ", 0, max_chars)
    return line[:cut + 1] if cut > 0 else line[:max_chars]
