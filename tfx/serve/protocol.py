"""The OpenAI request bodies the server reads (pydantic models) and its error shape.

Fields that OpenAI defines and tfx does not serve are refused when set to anything but their
neutral value (a penalty of 0, one prompt), never silently ignored; fields that do not change
the output (`user`, `metadata`, ...) are accepted and ignored, as OpenAI's own server does with
fields a model does not use.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

__all__ = ["ChatRequest", "CompletionRequest", "OpenAIError", "error_body"]


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)

    def body(self) -> dict:
        return error_body(self.message, param=self.param, kind=self.kind, code=self.code)


def error_body(message: str, *, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Sampling(pydantic.BaseModel):
    """The settings both endpoints share."""

    model_config = pydantic.ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @pydantic.field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float, info) -> float:
        if value != 0.0:
            raise ValueError(f"{info.field_name} is not served (0 only)")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=0)  # the chosen token's only
    echo: Literal[False] = False


class ChatMessage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> dict:
        """The message for a chat template: content parts of type text joined."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise OpenAIError(400, "only text content parts are served", param="messages")
            content = "".join(part.get("text", "") for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)  # the chosen token's only

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
