"""Continuous batching over the paged-KV engine.

The scheduler owns the engine and runs it in its own thread (the model is synchronous torch).
Callers talk to it through thread-safe calls: :meth:`Scheduler.submit` hands over a request and
a sink (called from the scheduler thread with each :class:`Output`), :meth:`Scheduler.cancel`
withdraws one. Between two steps the loop takes in new requests and cancellations, so a
cancelled request's pages are free before the next step runs.

Each request has a token list (prompt, then generated tokens) and ``computed``, the number of
those tokens whose K/V are in the cache. Its pending tokens ``tokens[computed:]`` are the
prompt (prefill), the last sampled token (decode), or everything after a preemption
(recompute); a step takes a chunk of them. When a chunk reaches the end of the list, the step's
logits for it give the next token. One step mixes decode tokens and prefill chunks:

1. running requests, oldest first: decodes take one token each; prefill chunks share the token
   budget left after the decodes;
2. waiting requests join, first come first served, while the budget, the running-request limit
   and the free pages (their whole pending prompt must fit) allow.

With the engine's prefix cache, a joining request starts on the longest cached prefix of its
tokens (``computed`` > 0) and needs pages only for the rest; cached pages no running request
holds count as free (the allocator evicts them on demand), so a full cache never blocks
admission. Admission counts what the request takes from them: a cached page it shares stops
being free.

Bounds: :meth:`Scheduler.submit` refuses a request with :class:`QueueFull` when
``max_queued`` requests (or ``max_queued_tokens`` prompt tokens) wait for admission already, and a
request whose deadline passes is finished with :class:`DeadlineExceeded` between two steps,
queued or running, its pages freed.

When the pages of a step do not fit, the newest running request is preempted: its pages are
freed and it goes back to the front of the queue, to be recomputed from its tokens later. Its
sampled tokens and generator state are kept, so the result is the one it would have had. With
the prefix cache its whole pages stay cached until evicted, so it may start again from them.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from coordinator.model.engine import Engine, Launched
from coordinator.serving.outputs import DeadlineExceeded, Output, QueueFull, SchedulerStopped, Sink
from coordinator.serving.sampler import SamplingParams, make_generator, sample
from coordinator.serving.scheduler_threads import StepThreads
from coordinator.serving.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from expertmesh import errors

if TYPE_CHECKING:
    from coordinator.serving.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

# A step an expert server refused for an older placement generation (a follower before it adopts
# the holder's push, a server re-pushed after a restart) runs again, after this pause, until the
# coordinator steps with the servers' generation, for up to STALE_RETRY_S; then its requests fail
STALE_RETRY_S = 2.0
STALE_PAUSE_S = 0.02

__all__ = ["DeadlineExceeded", "Output", "QueueFull", "Scheduler", "SchedulerStopped", "Sink"]


class Request:
    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        device: torch.device,
        tokenizer: TextTokenizer | None,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> None:
        self.rid, self.params, self.sink = rid, params, sink
        self.deadline = deadline  # time.monotonic() by which it must finish; None = none
        self.queued = True  # counted in the admission queue (until first admitted or finished)
        self.lora = lora  # MoE LoRA adapter name; None = base model
        self.num_prompt = len(prompt_ids)
        self.tokens = list(prompt_ids)
        self.logprobs: list[float] = []
        # params.prompt_logprobs: [i] for prompt token i + 1, filled by the prefill's chunks
        self.prompt_lps: list[float] = []
        self.prompt_top: list[list[tuple[int, float]]] = []
        self.generator = make_generator(params, device)
        self.detok: IncrementalDetokenizer | None = tokenizer.detokenizer(prompt_ids) if tokenizer else None
        self.stops = StopMatcher(params.stop) if params.stop else None
        self.seq: int | None = None  # engine sequence while it holds pages
        self.computed = 0
        # tokens sampled by launched steps and not read back yet (Scheduler: queued steps);
        # ``computed`` counts the K/V of the ones fed to a step already
        self.ahead = 0
        self.cached_tokens: int | None = None  # prompt tokens found cached, set when first admitted

    @property
    def pending(self) -> int:
        return len(self.tokens) + self.ahead - self.computed

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass(frozen=True)
class _Add:
    req: Request


@dataclass(frozen=True)
class _Cancel:
    rid: int


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], object]
    fut: Future


@dataclass(frozen=True)
class _Stop:
    pass


_Message = _Add | _Cancel | _Call | _Stop


@dataclass
class _Queued:
    """A decode step launched on the device whose samples the host has not read yet."""

    reqs: list[Request]  # its rows, in order
    run: Launched
    inputs: list[int] | None  # its input ids once the host knows them (a fed step's: later)
    tokens: torch.Tensor  # [b] int64 on the device: its samples, the next step's feed
    host: tuple[torch.Tensor, torch.Tensor]  # [b] the samples and their logprobs, copied back
    ready: torch.cuda.Event | None  # after those copies (None off CUDA: nothing to wait for)
    # each request's generator state before the step drew (None: greedy), restored if it fails
    draws: list[torch.Tensor | None] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)  # engine seqs of requests finished meanwhile


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_tokens: int = 512  # tokens per step (decodes + prefill chunks)
    max_running: int = 64  # requests holding KV pages at once
    max_context: int = 4096  # prompt + generated tokens of one request
    max_queued: int = 1024  # requests submitted but not yet admitted (QueueFull beyond)
    # prompt tokens of those; an empty queue takes any one request (its prompt fits the context)
    max_queued_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        assert self.max_batch_tokens > 0 and self.max_running > 0, f"{self}"
        assert self.max_context > 1, f"{self.max_context=}"
        assert self.max_queued > 0 and self.max_queued_tokens > 0, f"{self}"


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        limits: SchedulerLimits,
        tokenizer: TextTokenizer | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        capacity = engine.pages.num_pages * engine.page_size
        assert limits.max_context <= capacity, f"{limits.max_context=} > KV capacity {capacity} tokens"
        self.engine, self.limits, self.tokenizer = engine, limits, tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.num_preemptions = 0
        self._stale_since: float | None = None  # the first of the steps refused as stale in a row
        self.num_steps = 0
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._next_rid = 0
        self._rid_lock = threading.Lock()  # guards _next_rid and _stopped
        self._stopped = False
        self._queued = self._queued_tokens = 0  # guarded by _rid_lock (see Request.queued)
        self.num_rejected = self.num_expired = 0
        self._requests: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order, oldest first
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.metrics: CoordinatorMetrics | None = None  # set by the coordinator
        # a small CPU step runs on one intra-op thread (coordinator/serving/scheduler_threads.py)
        self.step_threads = StepThreads(engine.device, engine.config.hidden_size)
        # decode steps queued one ahead: the next step is launched (fed the samples on the
        # device) before the host reads this one's tokens, so the host's work per token runs
        # while the device computes; on by default where the engine captures decode graphs
        self.overlap = engine.graphs is not None
        self._queued_step: _Queued | None = None
        self.num_queued_steps = 0  # decode steps launched fed the samples of the step before them
        self.num_queued_failures = 0  # queued steps read back failed (run again with their successor)

    # ------------------------------------------------------------------ thread-safe API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the loop after the current step; unfinished requests get a SchedulerStopped error."""
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        lora: str | None = None,
        deadline: float | None = None,
    ) -> int:
        """Queues a request; ``sink`` is called from the scheduler thread and must not block.
        ``deadline`` is a ``time.monotonic()`` time. Raises :class:`QueueFull` (nothing queued)
        or :class:`SchedulerStopped`."""
        assert prompt_ids, "empty prompt"
        n, lim = len(prompt_ids), self.limits
        with self._rid_lock:
            if self._stopped:
                raise SchedulerStopped("the coordinator is shutting down")
            if self._queued >= lim.max_queued or (
                self._queued and self._queued_tokens + n > lim.max_queued_tokens
            ):
                self.num_rejected += 1
                if self.metrics is not None:
                    self.metrics.rejected()
                raise QueueFull(
                    f"the coordinator is overloaded: {self._queued} requests ({self._queued_tokens} prompt "
                    f"tokens) wait already (limits: --max-queued-requests {lim.max_queued}, "
                    f"--max-queued-tokens {lim.max_queued_tokens}); retry later"
                )
            self._queued += 1
            self._queued_tokens += n
            self._next_rid += 1
            rid = self._next_rid
        if self.metrics is not None:
            sink = self.metrics.track(sink, n)
        req = Request(rid, prompt_ids, params, sink, self.engine.device, self.tokenizer, lora, deadline)
        with self._rid_lock:
            stopped = self._stopped
            if not stopped:
                self._inbox.put(_Add(req))
        if stopped:
            self._dequeue(req)
            raise SchedulerStopped("the coordinator is shutting down")
        return rid

    def _dequeue(self, req: Request) -> None:
        """``req`` leaves the admission queue (admitted or finished); any thread."""
        with self._rid_lock:
            if req.queued:
                req.queued = False
                self._queued -= 1
                self._queued_tokens -= req.num_prompt

    def cancel(self, rid: int) -> None:
        self._inbox.put(_Cancel(rid))

    def call_between_steps(self, fn: Callable[[], object]) -> Future:
        """Runs ``fn`` on the scheduler thread between two steps (e.g. reconnecting expert
        servers, which must not race a step); the future holds its result or exception."""
        fut: Future = Future()
        with self._rid_lock:
            if self._stopped:
                fut.set_exception(SchedulerStopped("the coordinator is shutting down"))
                return fut
            self._inbox.put(_Call(fn, fut))
        return fut

    def uses_adapter(self, name: str) -> int:
        """Requests (waiting or running) using LoRA adapter ``name``; call on the scheduler thread."""
        return sum(1 for r in self._requests.values() if r.lora == name)

    def stats(self) -> dict[str, int]:
        return {
            "free_pages": self.engine.pages.num_free,
            "total_pages": self.engine.pages.num_pages,
            # pages in the prefix cache: held by requests, or kept (and counted in free_pages)
            "cached_pages": self.engine.prefix.num_pages if self.engine.prefix is not None else 0,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "queued": self._queued,
            "rejected": self.num_rejected,
            "expired": self.num_expired,
            "preemptions": self.num_preemptions,
            "steps": self.num_steps,
            "queued_steps": self.num_queued_steps,
            "queued_failures": self.num_queued_failures,
        }

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while True:
                idle = not (self._running or self._waiting or self._queued_step)
                t0 = time.perf_counter()
                if self._queued_step is not None and not self._inbox.empty():
                    self._drain()  # NOTE: calls between steps (commits, reconnections) and cancels see no step queued
                if not self._take_inbox(block=idle):
                    break
                # NOTE: a step's time includes the calls run between steps just before it
                # (placement commits, reconnections; running requests wait for them too), not
                # an idle wait for work
                if idle:
                    t0 = time.perf_counter()
                if self._queued_step is not None and not self._keeps_queue():
                    self._drain()
                self._expire()
                plan = self._schedule()
                q = self._queued_step
                if q is not None and (
                    len(plan) != len(q.reqs) or any(r is not x for (r, _), x in zip(plan, q.reqs))
                ):
                    self._drain()  # NOTE: not expected (_keeps_queue): the plan is made again
                    continue
                if plan:
                    steps = self.num_steps
                    self._run_step(plan)
                    if self.metrics is not None and self.num_steps > steps:
                        self.metrics.step_time(t0, decode=all(n == 1 for _, n in plan))
        except BaseException:
            log.exception("the scheduler loop died")
            raise
        finally:
            if self._queued_step is not None:
                try:
                    self._drain()
                except Exception:  # noqa: BLE001 - its requests are failed below
                    log.exception("the queued step failed while the scheduler stopped")
            with self._rid_lock:
                self._stopped = True
            while True:  # what was queued before the flag was set
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, _Add):
                    self._requests[msg.req.rid] = msg.req
                elif isinstance(msg, _Call):
                    msg.fut.set_exception(SchedulerStopped("the coordinator is shutting down"))
            for req in list(self._requests.values()):
                self._finish(req, "error", error=SchedulerStopped("the coordinator is shutting down"))

    def _take_inbox(self, block: bool) -> bool:
        """Applies queued submissions and cancellations; False once stop was asked."""
        try:
            msg = self._inbox.get(timeout=None) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, _Stop):
                return False
            if isinstance(msg, _Add):
                self._requests[msg.req.rid] = msg.req
                self._waiting.append(msg.req)
            elif isinstance(msg, _Cancel):
                req = self._requests.get(msg.rid)
                if req is not None:
                    self._finish(req, "cancelled")
            elif msg.fut.set_running_or_notify_cancel():
                try:
                    msg.fut.set_result(msg.fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                    msg.fut.set_exception(exc)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _expire(self) -> None:
        """Finishes every request whose deadline has passed (queued or running): its pages are
        free before the next step."""
        now = time.monotonic()
        late = [r for r in self._requests.values() if r.deadline is not None and r.deadline <= now]
        for req in late:
            where = "running" if req.seq is not None else "queued"
            self.num_expired += 1
            err = DeadlineExceeded(
                f"deadline exceeded: request {where}, {req.num_generated} of at most "
                f"{req.params.max_new_tokens} tokens generated"
            )
            self._finish(req, "error", error=err)

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, number of its pending tokens to compute)."""
        budget = self.limits.max_batch_tokens
        free = self.engine.pages.num_free
        decodes = sum(1 for r in self._running if r.pending == 1)
        prefill_budget = max(0, budget - decodes)
        plan: list[tuple[Request, int]] = []
        for req in list(self._running):
            if req.seq is None:  # preempted below, with everything newer
                break
            if req.pending == 1:
                n = 1 if budget > 0 else 0
            else:
                n = min(req.pending, prefill_budget)
            if n == 0:
                continue
            need = self.engine.pages_needed(req.seq, n)
            # NOTE: requests are planned oldest first, so the newest running one is never planned
            while need > free and self._running[-1] is not req:
                free += self._preempt(self._running[-1])
            if need > free:
                free += self._preempt(req)
                break
            plan.append((req, n))
            free -= need
            budget -= n
            if n > 1 or req.pending > 1:
                prefill_budget -= n
        while self._waiting and len(self._running) < self.limits.max_running and prefill_budget > 0:
            req = self._waiting[0]
            # NOTE: a prompt still to be scored computes every position: no cached prefix
            scoring = req.params.prompt_logprobs and len(req.prompt_lps) < req.num_prompt - 1
            tokens = () if scoring else req.tokens
            shared, kept = self.engine.prefix_hit(tokens, req.lora)
            whole = min(-(-(req.pending + 1) // self.engine.page_size), self.engine.pages.num_pages)
            if whole - shared + kept > free:
                break
            self._waiting.popleft()
            self._dequeue(req)
            before = self.engine.pages.num_free
            req.seq = self.engine.new_seq(tokens, req.lora)
            req.computed = self.engine.seqs[req.seq].cached
            free -= before - self.engine.pages.num_free  # kept pages it now shares
            if req.cached_tokens is None:  # not a preempted request coming back
                req.cached_tokens = min(req.computed, req.num_prompt)
                if self.metrics is not None:
                    self.metrics.prompt_cache(req.cached_tokens, req.num_prompt - req.cached_tokens)
            self._running.append(req)
            n = min(req.pending, prefill_budget)
            plan.append((req, n))
            free -= self.engine.pages_needed(req.seq, n)
            prefill_budget -= n
        return plan

    def _preempt(self, req: Request) -> int:
        """Frees ``req``'s pages and requeues it at the front; returns the pages freed (those it
        shared with running requests stay held)."""
        assert req.seq is not None
        before = self.engine.pages.num_free
        self.engine.free(req.seq)
        freed = self.engine.pages.num_free - before
        req.seq, req.computed = None, 0
        self._running.remove(req)
        self._waiting.appendleft(req)
        self.num_preemptions += 1
        log.debug("preempted request %d (%d tokens, %d pages)", req.rid, len(req.tokens), freed)
        return freed

    def _again_when_adopted(self, exc: BaseException) -> bool:
        """True: leave the refused step's requests as they are, to run again once the placement
        the servers committed is adopted (between steps; KV positions are rewritten, not
        added); False once steps have been refused as stale for STALE_RETRY_S."""
        now = time.monotonic()
        if self._stale_since is None:
            self._stale_since = now
            log.warning("a step was refused for its placement generation, running it again: %s", exc)
        if now - self._stale_since >= STALE_RETRY_S:
            self._stale_since = None
            return False
        time.sleep(STALE_PAUSE_S)  # NOTE: not a loop of refused steps while the adoption comes
        return True

    # ------------------------------------------------------------------ queued decode steps

    def _overlaps(self, plan: list[tuple[Request, int]]) -> bool:
        """Whether ``plan`` may be launched and sampled on the device, read back a step later: a
        base-model decode of every request, nothing asked of its logits but the samples."""
        if not self.overlap or not plan:
            return False
        for req, n in plan:
            p = req.params
            if n != 1 or req.pending != 1 or req.lora is not None or p.top_logprobs:
                return False
            if p.prompt_logprobs and req.computed < req.num_prompt:
                return False
        return True

    def _keeps_queue(self) -> bool:
        """Whether the next step may be queued behind the launched one: the same requests, none
        due to expire or waiting to join, and pages for all of them (no preemption)."""
        q = self._queued_step
        assert q is not None
        if self._waiting or len(self._running) != len(q.reqs):
            return False
        if any(r is not x for r, x in zip(self._running, q.reqs)):
            return False
        now = time.monotonic()
        if any(r.deadline is not None and r.deadline <= now for r in q.reqs):
            return False
        need = sum(self.engine.pages_needed(r.seq, 1) for r in q.reqs if r.seq is not None)
        return need <= self.engine.pages.num_free

    def _launch(self, plan: list[tuple[Request, int]]) -> bool:
        """Launches ``plan`` (see :meth:`_overlaps`) fed the queued step's samples if there is
        one, samples it on the device, then hands the queued step's tokens to their requests
        while this one runs. False when the launch failed with no step queued: nothing
        changed, the synchronous path runs the plan (and reports what fails). A queued step is
        read back when the launch behind it fails, and the plan made again."""
        prev = self._queued_step
        reqs = [r for r, _ in plan]
        assert prev is None or prev.reqs == reqs
        items = [(r.seq, 0 if prev is not None else r.tokens[-1]) for r in reqs]
        try:
            with self.step_threads.step(len(reqs)):
                run = self.engine.launch(items, None if prev is None else prev.tokens)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - the step runs again on the synchronous path, which reports it
            log.debug("decode step not queued", exc_info=True)
            if prev is None:
                return False
            self._drain()
            return True
        # NOTE: host state only (a CUDA generator's is its seed and offset): no stream wait
        draws = [r.generator.get_state() if r.generator is not None else None for r in reqs]
        try:
            toks, lps = sample(run.logits, [r.params for r in reqs], [r.generator for r in reqs])
        except BaseException:
            run.finish()
            run.undo()
            raise
        cuda = toks.device.type == "cuda"
        host = (
            torch.empty_like(toks, device="cpu", pin_memory=cuda),
            torch.empty_like(lps, device="cpu", pin_memory=cuda),
        )
        host[0].copy_(toks, non_blocking=cuda)
        host[1].copy_(lps, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        for r in reqs:
            r.computed += 1
            r.ahead += 1
        self.num_steps += 1
        self.num_queued_steps += prev is not None
        if self.metrics is not None:
            self.metrics.step(len(reqs))
        self._queued_step = _Queued(
            reqs, run, [r.tokens[-1] for r in reqs] if prev is None else None, toks, host, ready, draws
        )
        if prev is not None:
            self._read_back(prev)
        return True

    def _drain(self) -> None:
        """Reads the queued step back (waits for it): nothing stays queued."""
        q, self._queued_step = self._queued_step, None
        if q is not None:
            self._read_back(q)

    def _read_back(self, q: _Queued) -> None:
        """Step ``q``'s samples to its requests (it has ended once this returns). A step that
        failed (a linked step: nothing of it held) is undone with the one fed by it, and their
        requests planned again as they were before it."""
        later = self._queued_step  # the step fed with q's samples, if any
        inputs = q.inputs
        alive = (
            None if inputs is None else [tok if r.seq is not None else None for r, tok in zip(q.reqs, inputs)]
        )
        ok = _finished(q.run, alive)
        if not ok:
            self.num_queued_failures += 1
            log.warning("a queued decode step failed: it runs again, with the step queued behind it")
            if later is not None:
                later.run.cancel()
                _finished(later.run, None)
                later.run.undo()
                for r in later.reqs:
                    r.computed -= 1
                    r.ahead -= 1
                self._queued_step = None
            q.run.undo()
            for r, state in zip(q.reqs, q.draws):
                r.computed -= 1
                r.ahead -= 1
                if state is not None and r.generator is not None:  # seeded requests draw as if it never ran
                    r.generator.set_state(state)
            for seq in q.frees + (later.frees if later is not None else []):
                self.engine.free(seq)
            return
        if q.ready is not None:
            q.ready.synchronize()
        toks, lps = q.host[0].tolist(), q.host[1].tolist()
        if later is not None:
            later.inputs = toks
        for req, tok, lp in zip(q.reqs, toks, lps):
            if req.seq is None:  # finished meanwhile (its row computed for nothing)
                continue
            req.ahead -= 1
            self._emit_token(req, tok, lp, [])
        for seq in q.frees:
            self.engine.free(seq)

    def _run_step(self, plan: list[tuple[Request, int]]) -> None:
        if self._overlaps(plan) and self._launch(plan):
            return
        assert self._queued_step is None, "a synchronous step behind a queued one"
        items = []
        for req, n in plan:
            assert req.seq is not None
            items.append((req.seq, req.tokens[req.computed : req.computed + n]))
        adapters = [req.lora for req, _ in plan]
        # NOTE: every position's logits only when a request in prefill asks for its prompt's logprobs
        scoring = any(r.params.prompt_logprobs and r.computed < r.num_prompt for r, _ in plan)
        try:
            with self.step_threads.step(sum(n for _, n in plan)):
                logits = self.engine.step(
                    items, all_logits=scoring, adapters=adapters if any(adapters) else None
                )
        # NOTE: the thread boundary: whatever failed (an expert server, a bug) is reported to
        # the requests of this step, which are failed and freed; other requests keep going
        except Exception as exc:  # noqa: BLE001 - the thread boundary (above)
            if not _stale(exc):
                self._stale_since = None
            elif self._again_when_adopted(exc):
                return  # NOTE: nothing of the step is kept; its requests are planned again
            hit = _requests_of_rows(plan, getattr(exc, "rows", None))
            if hit and len(hit) < len(plan):
                # only some requests need an expert that no live server holds: fail those and
                # run the step again for the rest (their KV positions are rewritten, not added)
                log.warning("step failed for %d of %d requests: %s", len(hit), len(plan), exc)
                for i in hit:
                    self._finish(plan[i][0], "error", error=exc)
                self._run_step([p for i, p in enumerate(plan) if i not in hit])
                return
            if len(plan) > 1 and _refused_input(exc):
                # NOTE: a server refused what one request's own input made of the step (an
                # adapter or prompt that turns hidden states non-finite, say): halve the step
                # until the requests responsible run alone, so only they fail; KV positions of
                # the rest are rewritten by the re-run, as above
                log.warning("step of %d requests refused, running it in halves: %s", len(plan), exc)
                half = len(plan) // 2
                self._run_step(plan[:half])
                self._run_step(plan[half:])
                return
            log.warning("step of %d requests failed: %s", len(plan), exc)
            for req, _ in plan:
                self._finish(req, "error", error=exc)
            return
        self._stale_since = None
        self.num_steps += 1
        if self.metrics is not None:
            self.metrics.step(sum(n for _, n in plan))
        done = []
        for (req, n), row in zip(plan, logits):
            if scoring:  # row: [n, V], one per computed token
                if req.params.prompt_logprobs:
                    self._score_prompt(req, row)
                row = row[-1]
            req.computed += n
            if req.pending == 0 and req.params.max_new_tokens == 0:  # prompt logprobs only
                self._finish(req, "length", Output([], prompt_logprobs=req.prompt_lps,
                                                   prompt_top_logprobs=req.prompt_top))  # fmt: skip
            elif req.pending == 0:
                done.append((req, row))
        if done:
            reqs = [r for r, _ in done]
            toks, lps = sample(
                torch.stack([row for _, row in done]), [r.params for r in reqs], [r.generator for r in reqs]
            )
            for (req, row), tok, lp in zip(done, toks.tolist(), lps.tolist()):
                top = _top_logprobs(row, req.params.top_logprobs) if req.params.top_logprobs else []
                self._emit_token(req, tok, lp, top)

    def _score_prompt(self, req: Request, rows: torch.Tensor) -> None:  # rows [n, V]
        """Logprobs of the prompt tokens this chunk's logits predict (each position once: a
        request recomputed after a preemption scores nothing again)."""
        first = req.computed + 1  # the prompt position row 0 predicts
        end = min(req.num_prompt, req.computed + rows.shape[0] + 1)
        start = 1 + len(req.prompt_lps)
        if start >= end:
            return
        assert start >= first, f"prompt positions {start}..{first - 1} were never computed"
        lsm = torch.log_softmax(rows[start - first : end - first].float(), dim=-1)  # [m, V]
        want = torch.tensor(req.tokens[start:end], device=lsm.device)
        req.prompt_lps += lsm.gather(1, want[:, None]).squeeze(1).tolist()
        if req.params.top_logprobs:
            values, ids = lsm.topk(min(req.params.top_logprobs, lsm.shape[-1]))
            req.prompt_top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def _emit_token(self, req: Request, tok: int, logprob: float, top: list[tuple[int, float]]) -> None:
        req.tokens.append(tok)
        req.logprobs.append(logprob)
        p = req.params
        text, reason = "", None
        if req.detok is not None:
            text = req.detok.push(tok)
        if req.stops is not None:
            text, hit = req.stops.feed(text)
            reason = "stop" if hit else None
        if reason is None:
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
            elif req.num_generated >= p.max_new_tokens or len(req.tokens) >= self.limits.max_context:
                reason = "length"
            if reason is not None:
                text += self._flush_text(req)
        lps = [logprob] if p.logprobs else []
        tops = [top] if p.top_logprobs else []
        prompt = req.prompt_lps if p.prompt_logprobs and req.num_generated == 1 else None
        out = Output([tok], text, lps, top_logprobs=tops, prompt_logprobs=prompt,
                     prompt_top_logprobs=req.prompt_top if prompt is not None else [])  # fmt: skip
        if reason is None:
            req.sink(out)
        else:
            self._finish(req, reason, out)

    def _flush_text(self, req: Request) -> str:
        tail = req.detok.flush() if req.detok is not None else ""
        if req.stops is None:
            return tail
        text, _ = req.stops.feed(tail)
        return text + req.stops.flush()

    def _finish(
        self, req: Request, reason: str, last: Output | None = None, error: BaseException | None = None
    ) -> None:
        """Frees the request's pages and sends its final output."""
        if req.seq is not None:
            q = self._queued_step
            if q is not None and any(r is req for r in q.reqs):
                q.frees.append(req.seq)  # NOTE: the queued step still writes its K/V
            else:
                self.engine.free(req.seq)
            req.seq = None
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        self._requests.pop(req.rid, None)
        self._dequeue(req)
        last = last or Output([])
        req.sink(
            Output(
                last.token_ids,
                last.text,
                last.logprobs,
                finish_reason=reason,
                prompt_tokens=req.num_prompt,
                completion_tokens=req.num_generated,
                cached_tokens=req.cached_tokens or 0,
                error=error,
                top_logprobs=last.top_logprobs,
                prompt_logprobs=last.prompt_logprobs,
                prompt_top_logprobs=last.prompt_top_logprobs,
            )
        )


def _finished(run: Launched, tokens: list[int | None] | None) -> bool:
    """``run.finish``; an exception there (reading the step back, marking its server down) is
    logged and the step counts as failed: it runs again rather than ending the loop."""
    try:
        return run.finish(tokens)
    except Exception:  # noqa: BLE001 - the step is run again on the synchronous path, which reports
        log.exception("reading a queued decode step back failed")
        return False


def _top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:  # logits [V]
    """The ``n`` most likely tokens and their log-probabilities (the raw logits' log-softmax, as
    the sampled token's logprob)."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(n, logits.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))


def _stale(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal of the step's placement generation (FAILED_PRECONDITION)."""
    return isinstance(getattr(exc, "error", exc), errors.StaleGeneration)


def _refused_input(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal of the step's input (INVALID_ARGUMENT), typed or carried by
    an expert server's error, as opposed to a server or the coordinator failing."""
    return isinstance(getattr(exc, "error", exc), errors.InvalidRequest)


def _requests_of_rows(plan: list[tuple[Request, int]], rows: tuple[int, ...] | None) -> set[int]:
    """Indices into ``plan`` of the requests owning the step's token ``rows`` (the step's
    tokens are the plan's, in order; rows past them are graph padding)."""
    if not rows:
        return set()
    ends = list(itertools.accumulate(n for _, n in plan))
    return {bisect.bisect_right(ends, r) for r in rows if r < ends[-1]}
