"""A step an expert server refuses for an older placement generation (a follower in the moment
before it adopts the holder's push) loses no request: it runs again until the coordinator steps
with the new generation, and the requests produce the tokens of a refusal-free run; refused past
the retry window, its requests fail with the refusal."""

from __future__ import annotations

import grpc

from coordinator.experts.remote import ExpertServerError
from coordinator.model.dispatch import Dispatcher
from coordinator.serving import scheduler as sched
from expertmesh import errors
from tests.test_partial_step_failure import run_all
from tests.test_serving_scheduler import ckpt, make_scheduler  # noqa: F401 (fixture)


class Stale(Dispatcher):
    """Delegates to the real dispatcher; refuses the next ``refusals`` layer batches as a
    server does a request of a generation it no longer serves."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner, self.refusals, self.refused = inner, 0, 0

    def submit(self, layer, x, topk_ids, topk_weights):
        if self.refusals:
            self.refusals -= 1
            self.refused += 1
            err = errors.StaleGeneration("placement generation 3 is not the live generation 4")
            raise ExpertServerError(grpc.StatusCode.FAILED_PRECONDITION, err.message, err)
        return self.inner.submit(layer, x, topk_ids, topk_weights)


def test_a_stale_step_runs_again_and_no_request_is_lost(ckpt):  # noqa: F811
    s, flaky = make_scheduler(ckpt)
    stale = Stale(flaky.inner)
    s.engine.model.attach(stale)
    try:
        ref = [toks for toks, _ in run_all(s)]
        stale.refusals = 5  # the first steps of the next run are refused
        got = run_all(s)
        assert stale.refused == 5
        for (toks, last), want in zip(got, ref):
            assert last.finish_reason == "length" and toks == want
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
    finally:
        s.stop()


def test_steps_refused_past_the_window_fail_their_requests(ckpt, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sched, "STALE_RETRY_S", 0.2)
    s, flaky = make_scheduler(ckpt)
    stale = Stale(flaky.inner)
    s.engine.model.attach(stale)
    try:
        stale.refusals = 10**9
        got = run_all(s)
        assert all(last.finish_reason == "error" for _, last in got)
        assert all(isinstance(last.error.error, errors.StaleGeneration) for _, last in got)  # type: ignore[union-attr]
        assert stale.refused >= 2  # tried again before giving up
        stale.refusals = 0  # the next requests are served
        for toks, last in run_all(s):
            assert last.finish_reason == "length" and len(toks) == 6
        assert s.stats()["free_pages"] == s.stats()["total_pages"]
    finally:
        s.stop()
