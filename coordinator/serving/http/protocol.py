"""The OpenAI request bodies the HTTP server accepts (pydantic models) and OpenAI's error JSON.

Only the fields expertmesh acts on are declared; other OpenAI fields (``user``, ``suffix``,
``presence_penalty`` at its default, ...) are accepted and ignored, as vLLM does. ``top_k`` and
``ignore_eos`` are extensions (vLLM's and SGLang's names).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_INT32_MAX = 2**31 - 1


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(default=1, ge=1, le=16)
    # int32 in the gRPC message; 0 only for /v1/completions with echo (scores the prompt)
    max_tokens: int | None = Field(default=None, ge=0, le=_INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=_INT32_MAX)  # extension; 0 or -1 = no limit
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # extension (transformers' apply_chat_template flag)


ErrorType = Literal[
    "invalid_request_error",
    "not_found_error",
    "server_error",
    "service_unavailable_error",
    "permission_error",
    "rate_limit_error",  # 429: the admission queue is full
    "timeout_error",  # 504: the request's deadline passed
]


class APIError(Exception):
    """Raised by handlers; the app turns it into OpenAI's error JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
