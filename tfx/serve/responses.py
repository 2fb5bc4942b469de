"""OpenAI's response shapes, from the choices' deltas: whole responses and streamed chunks of
`/v1/completions` (object "text_completion") and `/v1/chat/completions`
("chat.completion" / "chat.completion.chunk")."""

from __future__ import annotations

import json
import time
import uuid

from tfx.serve.choices import Choices

__all__ = ["Response", "sse"]


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Response:
    """Builds the answer to one request. chat: a chat completion (else a text completion).
    logprobs: include the chosen tokens' log-probabilities."""

    def __init__(self, choices: Choices, model: str, *, chat: bool, logprobs: bool):
        self.choices, self.model, self.chat, self.logprobs = choices, model, chat, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict:
        prompt, completion = self.choices.prompt_tokens, self.choices.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def whole(self) -> dict:
        """The response once every choice has finished."""
        n = self.choices.body.n
        text, tokens, logprobs = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
        reasons = [None] * n
        async for delta in self.choices.deltas():
            text[delta.index] += delta.text
            tokens[delta.index] += delta.tokens
            logprobs[delta.index] += delta.logprobs
            reasons[delta.index] = delta.finish_reason
        choices = [self._choice(i, text[i], tokens[i], logprobs[i], reasons[i], whole=True)
                   for i in range(n)]
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage()}

    async def stream(self):
        """Server-sent events: each choice's deltas as chunks, then `[DONE]`."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:  # the role comes first, as OpenAI streams it
            for i in range(self.choices.body.n):
                yield sse({**self._head(kind), "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]})
        async for delta in self.choices.deltas():
            choice = self._choice(delta.index, delta.text, delta.tokens, delta.logprobs,
                                  delta.finish_reason, whole=False)
            yield sse({**self._head(kind), "choices": [choice]})
        if self.choices.body.include_usage:
            yield sse({**self._head(kind), "choices": [], "usage": self.usage()})
        yield sse("[DONE]")

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, tokens: list[int], logprobs: list[float],
                reason: str | None, *, whole: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": reason,
                    "logprobs": self._completion_logprobs(tokens, logprobs)}
        content = {"role": "assistant", "content": text} if whole else (
            {"content": text} if text else {})
        return {"index": index, "message" if whole else "delta": content, "finish_reason": reason,
                "logprobs": self._chat_logprobs(tokens, logprobs)}

    def _pieces(self, tokens: list[int]) -> list[str]:
        return [self.choices.tokenizer.decode([token]) for token in tokens]

    def _completion_logprobs(self, tokens, logprobs) -> dict | None:
        if not self.logprobs:
            return None
        return {"tokens": self._pieces(tokens), "token_logprobs": logprobs,
                "top_logprobs": None, "text_offset": None}

    def _chat_logprobs(self, tokens, logprobs) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [{"token": piece, "logprob": logprob,
                             "bytes": list(piece.encode()), "top_logprobs": []}
                            for piece, logprob in zip(self._pieces(tokens), logprobs,
                                                      strict=True)]}
