"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI request -> jobs -> OpenAI response,
whole or streamed as server-sent events (``data: {json}`` ... ``data: [DONE]``).

A choice is one scheduler request: ``n`` choices per prompt (seed ``s`` gives choice ``j`` the
seed ``s + j``, so choices differ yet repeat), and several prompts for ``/v1/completions``;
choice index = prompt index * n + j. Usage counts each prompt once and every choice's tokens;
``prompt_tokens_details.cached_tokens`` is the part of each prompt its first choice found in the
prefix cache.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from coordinator.serving.chat import ChatTemplateError
from coordinator.serving.http.generate import Job, chat_prompt_ids, make_job, run_jobs, usable_adapters
from coordinator.serving.http.protocol import APIError, ChatCompletionRequest, CompletionRequest
from coordinator.serving.scheduler import Output


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its request found in the prefix cache
    prompt: str | None = None  # the echoed prompt's text, once echoed

    def echo(self, text: str, prompt_ids: list[int], first: Output) -> None:
        """Puts the prompt before the completion (``echo``): its text, and with the request's
        prompt logprobs its tokens, ``null`` for the first (no context), then one each."""
        self.prompt = text
        self.text = text + self.text
        if first.prompt_logprobs is not None:
            self.token_ids = prompt_ids + self.token_ids
            self.logprobs = [None, *first.prompt_logprobs] + self.logprobs
            self.top = [None, *first.prompt_top_logprobs] + self.top

    def add(self, out: Output) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.top += out.top_logprobs
        if out.finish_reason is not None:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            self.completion_tokens = out.completion_tokens
            self.cached_tokens = out.cached_tokens


class Serving:
    """Handlers bound to one coordinator; ``model_name`` is what ``/v1/models`` lists."""

    def __init__(self, coord: Any, model_name: str) -> None:
        self.coord, self.model_name = coord, model_name

    # ------------------------------------------------------------ shared

    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> str:
        """Returns the LoRA adapter the ``model`` field selects ("" = the base model)."""
        if not self.coord.experts_ready:  # checked here too, before a stream's 200 goes out
            raise APIError(503, f"expert servers are not ready: {self.coord.expert_state()}",
                           "service_unavailable_error")  # fmt: skip
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(req, name):
                self.coord.metrics.invalid()
                raise APIError(400, f"{name} is not supported (only 0)", param=name)
        if req.max_tokens == 0 and not getattr(req, "echo", False):
            self.coord.metrics.invalid()
            raise APIError(400, "max_tokens 0 needs echo: true (to score the prompt)", param="max_tokens")
        if req.model == self.model_name:
            return ""
        adapters = adapter_names(self.coord)
        if req.model in adapters:
            return req.model
        known = [self.model_name, *adapters]
        self.coord.metrics.invalid()
        raise APIError(404, f"the model {req.model!r} does not exist; served: {known}", "not_found_error",
                       param="model", code="model_not_found")  # fmt: skip

    async def _jobs(
        self,
        prompts: list[dict[str, Any]],
        req: Any,
        lora: str,
        top_logprobs: int,
        logprobs: bool,
        prompt_logprobs: bool = False,
    ):
        jobs: list[Job] = []
        for p in prompts:
            for j in range(req.n):
                jobs.append(
                    await make_job(
                        self.coord,
                        **p,
                        max_tokens=getattr(req, "max_completion_tokens", None) or req.max_tokens,
                        temperature=req.temperature,
                        top_p=req.top_p,
                        top_k=req.top_k,
                        seed=None if req.seed is None else req.seed + j,
                        stop=req.stops(),
                        ignore_eos=req.ignore_eos,
                        logprobs=logprobs,
                        top_logprobs=top_logprobs,
                        lora=lora,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        return jobs

    def _usage(self, jobs: list[Job], choices: list[Choice], n: int) -> dict[str, Any]:
        firsts = range(0, len(jobs), n)  # each prompt counted once, as its first choice saw it
        prompt = sum(len(jobs[i].prompt_ids) for i in firsts)
        cached = sum(choices[i].cached_tokens for i in firsts)
        completion = sum(c.completion_tokens for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _token_text(self, tid: int) -> str:
        tok = self.coord.tokenizer
        return tok.tok.decode([tid], skip_special_tokens=False) if tok is not None else str(tid)

    # ------------------------------------------------------------ /v1/completions

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        lora = self._check_common(req)
        prompts = _completion_prompts(req.prompt)
        n_top = req.logprobs or 0
        # the prompt's logprobs come back too (max_tokens 0: the prefill is all that runs)
        scored = req.echo and (req.logprobs is not None or req.max_tokens == 0)
        jobs = await self._jobs(prompts, req, lora, n_top, req.logprobs is not None, scored)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if req.stream:
            return self._stream_completions(jobs, req, head)
        choices = [Choice() for _ in jobs]
        async with aclosing(run_jobs(self.coord, jobs)) as it:
            async for i, out in it:
                if req.echo and choices[i].prompt is None:
                    choices[i].echo(self._echo(jobs[i]), jobs[i].prompt_ids, out)
                choices[i].add(out)
        body = [
            {
                "index": i,
                "text": c.text,
                "logprobs": self._completion_logprobs(c.token_ids, c.logprobs, c.top, 0, n_top)
                if req.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        return {**head, "choices": body, "usage": self._usage(jobs, choices, req.n)}

    def _echo(self, job: Job) -> str:
        """The prompt's text, for ``echo`` (decoded from its ids when given as ids)."""
        if job.prompt_text is not None:
            return job.prompt_text
        tok = self.coord.tokenizer
        return tok.tok.decode(job.prompt_ids, skip_special_tokens=False) if tok is not None else ""

    def _completion_logprobs(self, ids, lps, top, offset: int, n_top: int) -> dict[str, Any]:
        """OpenAI's ``logprobs`` object; a ``None`` in ``lps`` / ``top`` (the echoed prompt's
        first token, which has no context) stays ``null``."""
        tokens = [self._token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = (
            [None if row is None else {self._token_text(t): lp for t, lp in row} for row in top]
            if n_top
            else None
        )
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def _stream_completions(self, jobs, req: CompletionRequest, head) -> AsyncIterator[str]:
        async for event in _errors_as_events(self._completion_events(jobs, req, head)):
            yield event

    async def _completion_events(self, jobs, req: CompletionRequest, head) -> AsyncGenerator[str, None]:
        choices = [Choice() for _ in jobs]
        n_top = req.logprobs or 0
        async with aclosing(run_jobs(self.coord, jobs)) as it:
            async for i, out in it:
                c = choices[i]
                offset = len(c.text)
                part = Choice()  # this event's: the echoed prompt first, if asked
                if req.echo and c.prompt is None:
                    text = self._echo(jobs[i])
                    c.echo(text, jobs[i].prompt_ids, out)
                    part.echo(text, jobs[i].prompt_ids, out)
                c.add(out)
                part.add(out)
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(part.token_ids, part.logprobs, part.top, offset, n_top)
                if part.text or out.finish_reason is not None or lp is not None:
                    choice = {"index": i, "text": part.text, "logprobs": lp, "finish_reason": c.finish_reason}
                    yield _sse({**head, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage(jobs, choices, req.n)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        lora = self._check_common(req)
        template = getattr(self.coord, "chat_template", None)
        if template is None:
            raise APIError(
                400, "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja): use /v1/completions", param="messages",
            )  # fmt: skip
        try:
            text = template.render([_flat(m.model_dump(exclude_none=True)) for m in req.messages],
                                   add_generation_prompt=req.add_generation_prompt)  # fmt: skip
        except ChatTemplateError as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None
        # NOTE: the template writes the special tokens (BOS, ...) itself, as in transformers
        ids = await chat_prompt_ids(self.coord, text)
        n_top = req.top_logprobs or 0
        if n_top and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        jobs = await self._jobs([{"input_ids": ids}], req, lora, n_top, req.logprobs)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
            return self._stream_chat(jobs, req, head)
        choices = [Choice() for _ in jobs]
        async with aclosing(run_jobs(self.coord, jobs)) as it:
            async for i, out in it:
                choices[i].add(out)
        body = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": self._chat_logprobs(c.token_ids, c.logprobs, c.top)}
                if req.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        head = {"id": rid, "object": "chat.completion", "created": created, "model": req.model}
        return {**head, "choices": body, "usage": self._usage(jobs, choices, req.n)}

    def _chat_logprobs(self, ids, lps, top) -> list[dict[str, Any]]:
        out = []
        for k, (t, lp) in enumerate(zip(ids, lps)):
            s = self._token_text(t)
            alts = [
                {"token": self._token_text(a), "logprob": alp, "bytes": list(self._token_text(a).encode())}
                for a, alp in (top[k] if k < len(top) else [])
            ]
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
        return out

    async def _stream_chat(self, jobs, req: ChatCompletionRequest, head) -> AsyncIterator[str]:
        async for event in _errors_as_events(self._chat_events(jobs, req, head)):
            yield event

    async def _chat_events(self, jobs, req: ChatCompletionRequest, head) -> AsyncGenerator[str, None]:
        choices = [Choice() for _ in jobs]
        for i in range(len(jobs)):
            delta = {"role": "assistant", "content": ""}
            yield _sse(
                {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
            )
        async with aclosing(run_jobs(self.coord, jobs)) as it:
            async for i, out in it:
                c = choices[i]
                c.add(out)
                lp = None
                if req.logprobs:
                    lp = {"content": self._chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs)}
                if out.text or out.finish_reason is not None or lp is not None:
                    delta = {"content": out.text} if out.text else {}
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}
                    yield _sse({**head, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage(jobs, choices, req.n)})
        yield "data: [DONE]\n\n"


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"input_ids": prompt}]
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    return [{"input_ids": p} for p in prompt]


def _flat(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) -> one string; text only."""
    content = message.get("content")
    if isinstance(content, list):
        kinds = {p.get("type") for p in content}
        if kinds - {"text"}:
            raise APIError(400, f"only text content parts are supported, got {sorted(map(str, kinds))}",
                           param="messages")  # fmt: skip
        message = {**message, "content": "".join(str(p.get("text", "")) for p in content)}
    return message


def adapter_names(coord: Any) -> list[str]:
    """LoRA adapters ``model`` may name (coordinator/lora: loaded on every expert server)."""
    return usable_adapters(coord)


async def _errors_as_events(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A failure after the stream's 200 went out (an expert server lost mid-request) becomes an
    event with OpenAI's error object, then ``[DONE]``, instead of a cut connection."""
    async with aclosing(events) as it:
        try:
            async for event in it:
                yield event
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
