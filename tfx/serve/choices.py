"""One request's choices, from the engine's updates to text: `Choices` submits the engine
requests of an OpenAI request (one per choice, `n`) and yields what each choice says next."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator

import jax
import numpy as np

from tfx.serve.protocol import OpenAIError, Sampling
from tfx.serve.text import ChoiceText
from tfx.serve.worker import EngineWorker, Listener

__all__ = ["Choices", "Delta"]

FINISH_REASONS = {"eos": "stop", "length": "length"}  # the engine's -> OpenAI's


@dataclasses.dataclass(frozen=True)
class Delta:
    """What choice `index` says next: text, the new tokens and their log-probabilities, and
    its finish reason ("stop", "length") when it ended."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


class Choices:
    """The `n` choices of one request, submitted to the engine by `start()`.

    prompt: int [prompt_len] token ids. max_tokens: new tokens per choice (None: as many as
    the model's max_len leaves). eos: ids that end a choice. variant: the engine's weight
    variant (the request's adapter).
    """

    def __init__(self, worker: EngineWorker, tokenizer, body: Sampling, prompt: np.ndarray, *,
                 max_tokens: int | None, eos: tuple[int, ...], variant: int):
        if len(prompt) == 0:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        max_len = worker.engine.max_len
        if max_tokens is None:
            max_tokens = max_len - len(prompt)
            if max_tokens < 1:
                raise OpenAIError(400, f"the prompt ({len(prompt)} tokens) fills the model's "
                                  f"context ({max_len} tokens)", param="messages")
        self.worker, self.tokenizer, self.body = worker, tokenizer, body
        self.prompt_tokens = len(prompt)
        self._requests = [dict(prompt=prompt, max_new_tokens=max_tokens,
                               eos_token_id=list(eos) or None, temperature=body.temperature,
                               top_k=body.top_k if body.top_k and body.top_k > 0 else None,
                               top_p=body.top_p, rng=key, variant=variant)
                          for key in _keys(body)]
        self.completion_tokens = 0
        self._ids: list[int] = []

    async def start(self) -> None:
        """Submit the choices (OpenAIError 400 when the engine refuses one)."""
        self._listener = Listener(asyncio.get_running_loop())
        try:
            self._ids = await self.worker.submit(self._requests, self._listener)
        except ValueError as error:
            raise OpenAIError(400, str(error)) from None
        except RuntimeError as error:
            raise OpenAIError(503, str(error), kind="server_error") from None

    async def deltas(self) -> AsyncIterator[Delta]:
        """What the choices say, as the engine makes it; the unfinished ones are cancelled
        (their pages freed) when the consumer stops early (a client that went away)."""
        texts = {request_id: ChoiceText(self.tokenizer, self.body.stops)
                 for request_id in self._ids}
        index = {request_id: i for i, request_id in enumerate(self._ids)}
        sent = dict.fromkeys(self._ids, 0)
        try:
            while texts:
                for update in await self._latest():
                    if update.request_id not in texts:
                        continue
                    if update.error is not None:
                        raise OpenAIError(503, update.error, kind="server_error")
                    text = texts[update.request_id]
                    new = text.update(update.tokens, final=update.finish_reason is not None)
                    reason = "stop" if text.stopped else FINISH_REASONS.get(update.finish_reason)
                    if reason is not None:
                        del texts[update.request_id]
                        self.completion_tokens += len(update.tokens)
                        if text.stopped:
                            self.worker.cancel([update.request_id])
                    if new or reason is not None:  # tokens held back go with the next text
                        start, sent[update.request_id] = (sent[update.request_id],
                                                          len(update.tokens))
                        yield Delta(index[update.request_id], new, update.tokens[start:],
                                    update.logprobs[start:], reason)
        finally:
            if texts:
                self.worker.cancel(list(texts))


    async def _latest(self) -> list:
        """The newest update of each choice among those queued (waiting for one): a client
        slower than the engine gets several tokens per chunk instead of a growing backlog."""
        updates = [await self._listener.queue.get()]
        while not self._listener.queue.empty():
            updates.append(self._listener.queue.get_nowait())
        return list({update.request_id: update for update in updates}.values())


def _keys(body: Sampling) -> list[np.ndarray | None]:
    """One raw key per choice: from `seed` (a fresh one without), none when greedy."""
    if body.temperature == 0:
        return [None] * body.n
    seed = secrets.randbits(32) if body.seed is None else body.seed
    keys = jax.random.split(jax.random.key(seed % 2**32), body.n)
    return list(np.asarray(jax.random.key_data(keys)))

