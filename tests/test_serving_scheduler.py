"""Scheduler behaviour below the gRPC layer: EOS, cancellation within a step, a failing step
(an expert server error) failing only its requests, a step a server refuses because of one
request's input failing that request alone, and the same failure through the API."""

from __future__ import annotations

import queue
import time

import grpc
import pytest
import torch

from coordinator.experts.remote import ExpertServerError
from coordinator.model.dispatch import Dispatcher
from coordinator.model.engine import Engine
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import Output, Scheduler, SchedulerLimits
from coordinator.serving.server import CoordinatorConfig
from expertmesh import errors
from expertmesh.client import Client
from tests.hf_models import make_checkpoint
from tests.serving_utils import (
    ServerThread,
    one_thread,  # noqa: F401 (autouse fixture)
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_sched")
    make_checkpoint("qwen3_moe", path, seed=1)
    return path


class Flaky(Dispatcher):
    """Delegates to the real dispatcher; fails every MoE layer while ``failing`` is set."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner, self.failing = inner, False

    def submit(self, layer, x, topk_ids, topk_weights):
        if self.failing:
            raise ExpertServerError(grpc.StatusCode.UNAVAILABLE, "cpu0 (127.0.0.1:1): stream closed")
        return self.inner.submit(layer, x, topk_ids, topk_weights)


class Picky(Dispatcher):
    """Delegates to the real dispatcher; refuses a layer whose routing weights are not finite,
    as an expert server does (INVALID_ARGUMENT)."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner, self.refused = inner, 0

    def submit(self, layer, x, topk_ids, topk_weights):
        if not bool(torch.isfinite(topk_weights).all()):
            self.refused += 1
            raise ExpertServerError.of(errors.InvalidRequest("weights contain NaN or infinity"))
        return self.inner.submit(layer, x, topk_ids, topk_weights)


class Collect:
    def __init__(self) -> None:
        self.q: queue.Queue[Output] = queue.Queue()

    def __call__(self, out: Output) -> None:
        self.q.put(out)

    def run(self, timeout: float = 30.0) -> tuple[list[int], Output]:
        toks = []
        while True:
            out = self.q.get(timeout=timeout)
            toks += out.token_ids
            if out.finish_reason is not None:
                return toks, out


def make_scheduler(ckpt, eos=(), num_pages=64, start=True) -> tuple[Scheduler, Flaky]:
    eng = Engine.from_checkpoint(str(ckpt), num_pages=num_pages, page_size=4)
    flaky = Flaky(eng.dispatcher)
    eng.model.attach(flaky)
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=16, max_running=8, max_context=128), eos_ids=eos)
    if start:
        s.start()
    return s, flaky


def test_eos_stops_unless_ignored(ckpt):
    s, _ = make_scheduler(ckpt)
    try:
        c = Collect()
        s.submit([4, 5, 6], SamplingParams(max_new_tokens=12), c)
        toks, _ = c.run()
    finally:
        s.stop()
    eos = toks[5]
    s, _ = make_scheduler(ckpt, eos=(eos,))
    try:
        c = Collect()
        s.submit([4, 5, 6], SamplingParams(max_new_tokens=12), c)
        got, last = c.run()
        assert last.finish_reason == "stop" and got == toks[: toks.index(eos) + 1]
        c = Collect()
        s.submit([4, 5, 6], SamplingParams(max_new_tokens=12, ignore_eos=True), c)
        got, last = c.run()
        assert last.finish_reason == "length" and got == toks
        assert last.completion_tokens == 12 and last.prompt_tokens == 3
    finally:
        s.stop()


class Stamped(Collect):
    """Collect that also notes when each output was delivered (the scheduler thread's clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[tuple[float, Output]] = []

    def __call__(self, out: Output) -> None:
        self.at.append((time.monotonic(), out))
        super().__call__(out)


def test_cancel_takes_effect_before_the_next_step(ckpt):
    s, _ = make_scheduler(ckpt)
    try:
        c, other = Stamped(), Collect()
        rid = s.submit([1, 2, 3], SamplingParams(max_new_tokens=100, ignore_eos=True), c)
        s.submit([7, 8], SamplingParams(max_new_tokens=30, ignore_eos=True), other)
        c.q.get(timeout=30)
        # NOTE: tokens delivered between that get and cancel() (this thread may lose its core on
        # a 2-core machine meanwhile) came before the cancel; only those after it are counted
        t_cancel = time.monotonic()
        s.cancel(rid)
        while True:
            out = c.q.get(timeout=30)
            if out.finish_reason is not None:
                break
        assert out.finish_reason == "cancelled"
        late = [tok for t, o in c.at if t > t_cancel for tok in o.token_ids]
        assert len(late) <= 1  # at most the step already under way when cancel() was called
        toks, last = other.run()
        assert last.finish_reason == "length" and len(toks) == 30
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
    finally:
        s.stop()


def test_failed_step_fails_its_requests_and_frees_their_pages(ckpt):
    s, flaky = make_scheduler(ckpt)
    try:
        c = Collect()
        s.submit([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True), c)
        c.q.get(timeout=30)
        flaky.failing = True
        _, last = c.run()
        assert last.finish_reason == "error" and isinstance(last.error, ExpertServerError)
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
        flaky.failing = False
        c = Collect()
        s.submit([1, 2, 3], SamplingParams(max_new_tokens=5), c)
        toks, last = c.run()
        assert last.finish_reason == "length" and len(toks) == 5
    finally:
        s.stop()


def test_a_request_whose_input_a_server_refuses_fails_alone(ckpt):
    """One request's prompt turns its hidden states into NaN (as a broken adapter would): the
    servers refuse every step it is part of, yet its batch neighbours finish with the tokens
    they get alone."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    s, _ = make_scheduler(ckpt)
    try:
        alone = []
        for p in prompts:
            c = Collect()
            s.submit(p, params, c)
            alone.append(c.run()[0])
    finally:
        s.stop()
    used = {t for p, toks in zip(prompts, alone) for t in p + toks}
    poison = next(t for t in range(20, 100) if t not in used)

    s, _ = make_scheduler(ckpt, start=False)  # all five are queued before the first step
    picky = Picky(s.engine.dispatcher)
    s.engine.model.attach(picky)

    def nan_rows(_mod, inp, out):  # the poisoned token's embedding is NaN
        return out.masked_fill((inp[0] == poison)[:, None], float("nan"))

    s.engine.model.model.embed_tokens.register_forward_hook(nan_rows)
    try:
        cs = [Collect() for _ in range(len(prompts) + 1)]
        for c, p in zip(cs, [*prompts[:2], [poison, 5, 6], *prompts[2:]]):
            s.submit(p, params, c)
        s.start()
        results = [c.run() for c in cs]
        bad = results.pop(2)[1]
        assert bad.finish_reason == "error" and isinstance(bad.error, ExpertServerError)
        assert isinstance(bad.error.error, errors.InvalidRequest)
        assert picky.refused > 0
        for (toks, last), want in zip(results, alone):
            assert last.finish_reason == "length" and last.error is None
            assert toks == want
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
    finally:
        s.stop()


def test_stop_fails_unfinished_requests(ckpt):
    s, _ = make_scheduler(ckpt)
    c = Collect()
    s.submit([1, 2, 3], SamplingParams(max_new_tokens=120, ignore_eos=True), c)
    c.q.get(timeout=30)
    s.stop()
    _, last = c.run()
    assert last.finish_reason == "error" and "shutting down" in str(last.error)


def test_expert_failure_is_unavailable_through_the_api(ckpt):
    with ServerThread(CoordinatorConfig(model_dir=str(ckpt), port=0, page_size=4)) as s:
        eng = s.scheduler.engine
        flaky = Flaky(eng.dispatcher)
        s.scheduler.call_between_steps(lambda: eng.model.attach(flaky, s.server.load.record)).result(10)
        with Client(s.addr) as c:
            flaky.failing = True
            with pytest.raises(grpc.RpcError) as e:
                c.generate(input_ids=[1, 2, 3], max_new_tokens=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "expert server" in e.value.details() and "cpu0" in e.value.details()
            flaky.failing = False
            assert len(c.generate(input_ids=[1, 2, 3], max_new_tokens=5).token_ids) == 5
        deadline = time.monotonic() + 5
        while s.scheduler.stats()["free_pages"] != s.scheduler.stats()["total_pages"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
