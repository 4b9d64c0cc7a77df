"""The HTTP server's way into the scheduler: the same validation (``parse_request``) and the
same ``Scheduler.submit`` / ``cancel`` as the gRPC Generation servicer, without a gRPC hop.

:func:`run_jobs` submits one or more requests (``n`` choices, several prompts), yields their
outputs as they come, and cancels whatever has not finished when the caller stops iterating
(the client went away, an error), which frees the requests' KV pages before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.serving.http.protocol import APIError, ErrorType
from coordinator.serving.outputs import Output, QueueFull, SchedulerStopped, error_status
from coordinator.serving.requests import InvalidRequest, check_prompt_bytes, parse_request_async
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.tokenizer import PromptTooLong
from expertmesh.v1 import generation_pb2

# gRPC status of a failed step -> HTTP status
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    lora: str | None = None  # the LoRA adapter the request's ``model`` selected; None = base
    prompt_text: str | None = None  # the prompt as given, when given as text (for ``echo``)


async def make_job(
    coord: Any,
    *,
    prompt: str | None = None,
    input_ids: Sequence[int] | None = None,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: list[str],
    ignore_eos: bool,
    logprobs: bool,
    top_logprobs: int,
    lora: str = "",
    prompt_logprobs: bool = False,
) -> Job:
    """Validates one request exactly as the gRPC API does; bad values raise a 400 APIError."""
    # NOTE: JSON's "\ud800" is a lone surrogate that protobuf refuses to hold (UnicodeEncodeError)
    for what, text in [("prompt", prompt or ""), *((f"stop[{i}]", t) for i, t in enumerate(stop))]:
        if not _is_unicode(text):
            coord.metrics.invalid()
            raise APIError(400, f"{what} is not valid Unicode text (it holds a lone surrogate)", param=what)
    # NOTE: the gRPC message holds int32 ids; JSON integers are unbounded (protobuf: ValueError)
    bad = [i for i in input_ids or () if not -(2**31) <= i < 2**31]
    if bad:
        coord.metrics.invalid()
        vocab = coord.request_limits.vocab_size
        raise APIError(400, f"input_ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="prompt")
    req = generation_pb2.GenerateRequest(
        prompt=prompt or "",
        input_ids=list(input_ids or ()),
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        stop=stop,
        ignore_eos=ignore_eos,
        logprobs=logprobs or top_logprobs > 0,
        lora=lora,
        prompt_logprobs=prompt_logprobs,
    )
    if max_tokens is not None:
        req.max_new_tokens = max_tokens
    if seed is not None:
        req.seed = seed
    try:
        # NOTE: off the event loop for a long prompt (one prompt must not stall all)
        ids, params = await parse_request_async(
            req, coord.request_limits, coord.tokenizer, usable_adapters(coord)
        )
    except InvalidRequest as e:
        coord.metrics.invalid()
        # the gRPC field names in the shared messages, in OpenAI's words
        raise APIError(400, str(e).replace("max_new_tokens", "max_tokens")) from None
    return Job(ids, dataclasses.replace(params, top_logprobs=top_logprobs), lora or None, prompt)


async def chat_prompt_ids(coord: Any, text: str) -> list[int]:
    """A rendered chat's ids, under the same byte and context limits as a prompt, tokenized
    off the event loop (the template writes the special tokens itself)."""
    limits = coord.request_limits
    try:
        check_prompt_bytes(text, limits.input)
        return await asyncio.to_thread(
            coord.tokenizer.encode, text, max_tokens=limits.max_context - 1, add_special_tokens=False
        )
    except InvalidRequest as e:
        raise APIError(400, str(e), param="messages") from None
    except PromptTooLong as e:
        msg = f"prompt of {e.tokens} tokens does not fit the max context of {limits.max_context} tokens"
        raise APIError(400, msg, param="messages") from None


async def run_jobs(coord: Any, jobs: list[Job]) -> AsyncGenerator[tuple[int, Output], None]:
    """Yields ``(job index, output)`` until every job has finished; a failed job raises APIError."""
    if not coord.experts_ready:
        raise APIError(
            503, f"expert servers are not ready: {coord.expert_state()}", "service_unavailable_error"
        )
    outputs: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink_for(i: int):
        def sink(out: Output) -> None:  # scheduler thread
            with contextlib.suppress(RuntimeError):  # the event loop closed under a shutdown
                loop.call_soon_threadsafe(outputs.put_nowait, (i, out))

        return sink

    rids: dict[int, int] = {}
    deadline = coord.deadline(None)  # HTTP has no client deadline: --request-timeout only
    try:
        for i, job in enumerate(jobs):
            rids[i] = coord.scheduler.submit(
                job.prompt_ids, job.params, sink_for(i), lora=job.lora, deadline=deadline
            )
        while rids:
            i, out = await outputs.get()
            if out.finish_reason is not None:
                rids.pop(i, None)
                if out.error is not None:
                    raise _api_error(out.error)
            yield i, out
    except SchedulerStopped as e:
        raise APIError(503, str(e), "service_unavailable_error") from None
    except QueueFull as e:  # OpenAI's answer to too many requests
        raise APIError(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
    finally:
        for rid in rids.values():  # the client went away or another choice failed
            coord.scheduler.cancel(rid)


def _api_error(exc: BaseException) -> APIError:
    code, msg = error_status(exc)
    status = _HTTP_STATUS.get(code, 500)
    kind: dict[int, ErrorType] = {
        503: "service_unavailable_error",
        504: "timeout_error",
        429: "rate_limit_error",
    }
    return APIError(status, msg, kind.get(status, "server_error"))


def usable_adapters(coord: Any) -> list[str]:
    """LoRA adapters a request may name: loaded and acknowledged by every expert server."""
    lora = getattr(coord, "lora", None)
    return sorted(lora.usable) if lora is not None else []


def _is_unicode(text: str) -> bool:
    """False for a str that UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
