"""JSON-lines readers for supervised fine-tuning (SFT) and preference tuning (DPO).

One JSON object per line; blank lines are skipped, line numbers are 1-based physical lines (split
on "\\n" only). SFT lines are one of

    {"prompt": "What is 2+2?", "completion": " It is four."}            plain, no template
    {"messages": [{"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}           chat template
    {"prompt": [messages], "completion": [messages]}                       chat, loss on completion

and preference lines `{"prompt": str, "chosen": str, "rejected": str}` (plain) or a messages list
as prompt with lists of assistant messages as chosen and rejected. Roles are system, user,
assistant and tool; content is a string; other keys of a line or message are passed on / ignored.

A bad line raises `ValueError("path:line: what is wrong; what is expected")` before any further
line is read, or with `skip_bad=True` is counted and skipped. Rows are never truncated: one longer
than `max_tokens` is a bad line. numpy only, no jax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np

from tfx.train.chat import ChatTokenizer

__all__ = ["ROLES", "Example", "Pair", "read_preference", "read_sft"]

ROLES = ("system", "user", "assistant", "tool")
_SFT_FORMATS = ('{"prompt": str, "completion": str}, {"messages": [...]} or '
                '{"prompt": [messages], "completion": [messages]}')
_PAIR_FORMATS = ('{"prompt": str, "chosen": str, "rejected": str} or {"prompt": [messages], '
                 '"chosen": [assistant messages], "rejected": [assistant messages]}')


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One SFT row: `ids` int32 [n] and `loss_mask` bool [n], True where token i is a target (a
    completion or assistant token, predicted from the tokens before it)."""

    ids: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self):
        if (self.ids.ndim != 1 or self.ids.dtype != np.int32 or self.loss_mask.dtype != bool
                or self.loss_mask.shape != self.ids.shape):
            raise ValueError(f"Example needs ids int32 [n] and loss_mask bool [n], got "
                             f"{self.ids.dtype}{list(self.ids.shape)} and "
                             f"{self.loss_mask.dtype}{list(self.loss_mask.shape)}")


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
    """One preference row: `prompt` int32 [p], `chosen` int32 [c], `rejected` int32 [r]; the
    model scores `prompt + chosen` against `prompt + rejected`."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    def __post_init__(self):
        for name in ("prompt", "chosen", "rejected"):
            value = getattr(self, name)
            if value.ndim != 1 or value.dtype != np.int32:
                raise ValueError(f"Pair.{name} must be int32 [n], got "
                                 f"{value.dtype}{list(value.shape)}")


class _BadLine(ValueError):
    """What is wrong with one line (the reader adds "path:line: "); skipped under skip_bad."""


def read_sft(path: str | os.PathLike, tokenizer: ChatTokenizer, *, max_tokens: int,
             skip_bad: bool = False) -> tuple[list[Example], int]:
    """The SFT examples of a JSONL file, in file order, and how many bad lines were skipped.

    Plain lines are `tokenizer.encode_completion(prompt, completion)` (BOS + prompt + completion +
    EOS, loss on completion and EOS); "messages" lines are `tokenizer.encode_chat(messages)` (the
    ids of `apply_chat_template`, loss on each assistant turn and its end marker); conversational
    prompt-completion lines are `tokenizer.encode_chat_completion` (loss on the completion).

    Raises:
      ValueError: "path:line: ..." for a bad line (unless `skip_bad`), a chat line when the
        tokenizer has no template (never skipped); naming the path for a missing or empty file,
        or one whose every line is bad.
    """
    _check_max_tokens(max_tokens)
    return _read(path, skip_bad, lambda record: _example(record, tokenizer, max_tokens))


def read_preference(path: str | os.PathLike, tokenizer: ChatTokenizer, *, max_tokens: int,
                    skip_bad: bool = False) -> tuple[list[Pair], int]:
    """The preference pairs of a JSONL file, in file order, and how many bad lines were skipped.

    Plain: prompt = BOS + prompt tokens, chosen/rejected = their tokens + EOS. Chat: prompt = the
    tokens of `render(prompt, add_generation_prompt=True)`, chosen = the tokens the rendering of
    `prompt + chosen` adds after it, up to the turn's end marker (as `encode_chat_completion`).
    A pair whose `prompt + chosen` or `prompt + rejected` is longer than `max_tokens` is bad.

    Raises:
      ValueError: as `read_sft`.
    """
    _check_max_tokens(max_tokens)
    return _read(path, skip_bad, lambda record: _pair(record, tokenizer, max_tokens))


def _check_max_tokens(max_tokens: int) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer):
        raise TypeError(f"max_tokens must be an int, got {max_tokens!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


def _read(path: str | os.PathLike, skip_bad: bool, parse: Callable[[dict], object]
          ) -> tuple[list, int]:
    """`parse` applied to the JSON object of each non-blank line; (results, number skipped)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"{str(path)!r}: no such file")
    items, lines, first_bad = [], 0, None
    # Binary lines split on b"\n" alone: the numbers are those an editor shows, whatever
    # "\r" or "\u2028" the text holds.
    with file.open("rb") as stream:
        for number, raw in enumerate(stream, 1):
            if not raw.strip():
                continue
            lines += 1
            try:
                items.append(parse(_record(raw, number)))
            except _BadLine as err:
                if not skip_bad:
                    raise ValueError(f"{path}:{number}: {err}") from None
                first_bad = first_bad or f"{path}:{number}: {err}"
            except ValueError as err:  # not the line's fault (no template ...): never skipped
                raise ValueError(f"{path}:{number}: {err}") from err
    if not lines:
        raise ValueError(f"{str(path)!r} is empty: expected one JSON object per line")
    if not items:
        raise ValueError(f"{str(path)!r}: all {lines} lines are bad, the first: {first_bad}")
    return items, lines - len(items)


def _record(raw: bytes, number: int) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _BadLine(f"not UTF-8 ({err.reason} at byte {err.start})") from None
    if number == 1:
        text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise _BadLine(f"not JSON ({err.msg} at column {err.colno}); expected one JSON object "
                       "per line") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {type(record).__name__}")
    return record


def _field(record: dict, name: str, formats: str):
    if name not in record:
        raise _BadLine(f"missing field {name!r}; expected {formats}")
    return record[name]


def _messages(value, name: str, *, roles=ROLES, need_assistant: bool = False) -> list[dict]:
    """`value` checked as a non-empty list of {"role", "content": str} messages."""
    if not isinstance(value, list) or not value:
        raise _BadLine(f"{name!r} must be a non-empty list of messages, got {value!r:.80}")
    for i, message in enumerate(value):
        where = f"message {i} of {name!r}"
        if not isinstance(message, dict):
            raise _BadLine(f"{where} must be an object {{\"role\", \"content\"}}, "
                           f"got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if role not in roles:
            raise _BadLine(f"{where}: unknown role {role!r}; expected one of {', '.join(roles)}")
        if not isinstance(content, str):
            raise _BadLine(f"{where}: 'content' must be a string, got {content!r:.80}")
        if role == "assistant" and not content.strip():
            raise _BadLine(f"{where}: empty assistant content; expected text to learn")
    if need_assistant and not any(m["role"] == "assistant" for m in value):
        raise _BadLine(f"{name!r} has no assistant message; expected at least one to learn from")
    return value


def _chat(tokenizer: ChatTokenizer, encode, *args) -> tuple[np.ndarray, np.ndarray]:
    """`encode(*args)` with a template's refusal of these messages made a bad line."""
    if tokenizer.chat_template is None:
        raise ValueError(f"a line of chat messages needs a chat template and {tokenizer!r} has "
                         'none; the {"prompt": str, "completion": str} format works without one')
    try:
        return encode(*args)
    except ValueError as err:
        raise _BadLine(str(err)) from None


def _check_length(length: int, what: str, max_tokens: int) -> None:
    if length > max_tokens:
        raise _BadLine(f"{what} is {length} tokens, more than max_tokens={max_tokens}; rows are "
                       "never truncated: shorten it or raise max_tokens")


def _example(record: dict, tokenizer: ChatTokenizer, max_tokens: int) -> Example:
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise _BadLine(f"a line has 'messages' or 'prompt' and 'completion', not both; "
                           f"expected {_SFT_FORMATS}")
        messages = _messages(record["messages"], "messages", need_assistant=True)
        ids, mask = _chat(tokenizer, tokenizer.encode_chat, messages)
    elif "prompt" in record or "completion" in record:
        prompt = _field(record, "prompt", _SFT_FORMATS)
        completion = _field(record, "completion", _SFT_FORMATS)
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise _BadLine("empty 'completion'; expected text to learn")
            ids, mask = tokenizer.encode_completion(prompt, completion)
        elif isinstance(prompt, list) and isinstance(completion, list):
            ids, mask = _chat(tokenizer, tokenizer.encode_chat_completion,
                              _messages(prompt, "prompt"),
                              _messages(completion, "completion", need_assistant=True))
        else:
            raise _BadLine(f"'prompt' and 'completion' must both be strings or both lists of "
                           f"messages, got {type(prompt).__name__} and "
                           f"{type(completion).__name__}")
    else:
        raise _BadLine(f"expected {_SFT_FORMATS}, got the keys {sorted(record)}")
    _check_length(len(ids), "the example", max_tokens)
    return Example(ids, mask)


def _pair(record: dict, tokenizer: ChatTokenizer, max_tokens: int) -> Pair:
    prompt, chosen, rejected = (_field(record, name, _PAIR_FORMATS)
                                for name in ("prompt", "chosen", "rejected"))
    answers = {"chosen": chosen, "rejected": rejected}
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        for name, answer in answers.items():
            if not answer.strip():
                raise _BadLine(f"empty {name!r}; expected a non-empty answer")
        rows = {name: tokenizer.encode_completion(prompt, answer)
                for name, answer in answers.items()}
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        prompt = _messages(prompt, "prompt")
        for name, answer in answers.items():
            _messages(answer, name, roles=("assistant",))
        rows = {name: _chat(tokenizer, tokenizer.encode_chat_completion, prompt, answer)
                for name, answer in answers.items()}
    else:
        raise _BadLine(f"expected {_PAIR_FORMATS}, got "
                       + ", ".join(type(v).__name__ for v in (prompt, chosen, rejected)))
    prompts, parts = {}, {}
    for name, (ids, mask) in rows.items():
        # The answer is the contiguous masked run; the chat rendering's whitespace after the
        # turn's end marker belongs to neither side.
        where = np.flatnonzero(mask)
        if not where.size:
            raise _BadLine(f"{name!r} renders to no tokens; expected a non-empty answer")
        prompts[name], parts[name] = ids[:where[0]], ids[where[0]:where[-1] + 1]
        _check_length(len(prompts[name]) + len(parts[name]), f"prompt + {name}", max_tokens)
    if not np.array_equal(prompts["chosen"], prompts["rejected"]):
        raise _BadLine("the prompt tokenizes differently before 'chosen' and 'rejected' (its "
                       "last token joins with the answer); expected a prompt that ends cleanly")
    return Pair(prompts["chosen"], parts["chosen"], parts["rejected"])
