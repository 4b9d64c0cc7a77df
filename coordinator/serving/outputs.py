"""What the scheduler hands back for a request: its streamed :class:`Output` chunks, the sink
that receives them, the errors that end a request early and the gRPC status each maps to
(:func:`error_status`, which the HTTP layer turns into its own codes). Kept apart from the
scheduler and the servicers so that metrics, gRPC and HTTP share them without importing each
other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from coordinator.experts.expert_conn import ExpertServerError


class SchedulerStopped(RuntimeError):
    """The scheduler shut down before the request finished."""


class QueueFull(RuntimeError):
    """Too many requests wait for admission (RESOURCE_EXHAUSTED / HTTP 429): retry later."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED / HTTP 504)."""


@dataclass(frozen=True)
class Output:
    """What one step produced for one request (the last one carries ``finish_reason``)."""

    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (not computed)
    error: BaseException | None = None  # set with finish_reason "error"
    # per token, the params.top_logprobs most likely (token id, logprob) pairs, when asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # params.prompt_logprobs, in the request's first output: one per prompt token after the
    # first (which has no context), and their top_logprobs as above
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


Sink = Callable[[Output], None]


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ExpertServerError):
        return exc.code, f"expert server failure: {exc}"
    if isinstance(exc, SchedulerStopped):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
