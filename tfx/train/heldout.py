"""Held-out evaluation of a causal LM on a file (`tfx eval --data FILE`): loss, perplexity and
the number of tokens scored.

What is scored, by the file's kind:
- text (a file, or a folder as `tfx.train.data.text_files` reads it): every document is cut
  into consecutive windows of `seq_len + 1` tokens that overlap by one, so every token after
  a document's first is predicted exactly once, from the tokens of its window before it;
- JSONL of {"text": ...} lines: each line a document, scored as text;
- JSONL of sft lines ({"prompt", "completion"} or {"messages"}, `tfx.train.instructions`):
  only the answer tokens, as the sft objective trains them.
Loss is the mean negative log-likelihood in nats per scored token; perplexity its exp.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tfx.train.data import Tokenizer, text_files

__all__ = ["heldout_metrics", "heldout_rows"]


def heldout_rows(path: str | pathlib.Path, tokenizer: Tokenizer, seq_len: int,
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(token rows, loss masks): int32 / bool 1-D arrays of at most seq_len + 1 tokens, the
    mask True on the tokens to score (see the module docstring)."""
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
        first = _first_record(path)
        if "text" not in first:
            from tfx.train.instructions import read_sft

            examples, _ = read_sft(path, tokenizer, max_tokens=seq_len + 1)
            return [e.ids for e in examples], [e.loss_mask for e in examples]
        texts = [_text_field(path, n, line) for n, line in _lines(path)]
    else:
        texts = [text for _, text in text_files(path)]
    rows, masks = [], []
    for text in texts:
        ids = np.asarray(tokenizer.encode(text), np.int32)
        for start in range(0, max(len(ids) - 1, 0), seq_len):
            window = ids[start:start + seq_len + 1]
            rows.append(window)
            masks.append(np.arange(len(window)) > 0)  # the first token is context only
    if not rows:
        raise ValueError(f"--data: {path} holds no document of two tokens or more to score")
    return rows, masks


def heldout_metrics(model: nnx.Module, tokenizer: Tokenizer, path: str | pathlib.Path, *,
                    seq_len: int, batch_size: int = 8) -> dict[str, float]:
    """{"loss", "perplexity", "tokens"} of `model` (a causal LM) on the file `path`.

    Rows are padded on the right to seq_len + 1 and scored batch_size at a time by one
    compiled program (padding is masked out: causal attention keeps it out of real tokens).
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    rows, masks = heldout_rows(path, tokenizer, seq_len)
    graphdef, state = nnx.split(model)
    total, count = 0.0, 0.0
    for start in range(0, len(rows), batch_size):
        tokens, weights = _padded(rows[start:start + batch_size], masks[start:start + batch_size],
                                  batch_size, seq_len + 1)
        batch_total, batch_count = _score(graphdef, state, tokens, weights)
        total, count = total + float(batch_total), count + float(batch_count)
    if not count:
        raise ValueError(f"--data: {path} has no token to score")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count)}


@jax.jit
def _score(graphdef, state, tokens: jax.Array, weights: jax.Array):
    """Summed next-token NLL of tokens [B, L] where weights[:, 1:], and the count."""
    logits = nnx.merge(graphdef, state)(tokens[:, :-1]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    weights = weights[:, 1:].astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def _padded(rows, masks, batch_size: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((batch_size, width), np.int32)
    weights = np.zeros((batch_size, width), bool)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, :len(row)], weights[i, :len(row)] = row, mask
    return tokens, weights


def _lines(path: pathlib.Path):
    """(1-based line number, text) of the file's non-blank lines."""
    try:
        with path.open(encoding="utf-8") as file:
            yield from ((n, line) for n, line in enumerate(file, 1) if line.strip())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--data: cannot read {path} ({error})") from None


def _first_record(path: pathlib.Path) -> dict:
    for n, line in _lines(path):
        return _record(path, n, line)
    raise ValueError(f"--data: {path} holds no JSON line")


def _record(path: pathlib.Path, n: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{n}: not JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
    return record


def _text_field(path: pathlib.Path, n: int, line: str) -> str:
    text = _record(path, n, line).get("text")
    if not isinstance(text, str):
        raise ValueError(f"{path}:{n}: expected a string \"text\" field, as the file's first "
                         "line has")
    return text
