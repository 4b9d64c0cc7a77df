"""A step in which only some requests need an expert that no live server holds fails just
those requests; the others of the same step go on and produce the tokens of a fault-free run."""

from __future__ import annotations

import grpc

from coordinator.experts.remote import ExpertServerError
from coordinator.model.dispatch import Dispatcher
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import _requests_of_rows
from tests.test_serving_scheduler import Collect, ckpt, make_scheduler  # noqa: F401 (fixture)

PROMPTS = [[1, 2, 3], [7, 8], [11, 4, 9, 2], [5], [13, 6], [3, 3, 8]]


class Lost(Dispatcher):
    """Delegates to the real dispatcher; while ``expert`` is set, a layer-0 batch that routes
    some tokens to it raises as RemoteDispatcher does when no live server holds it."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner, self.expert = inner, None

    def submit(self, layer, x, topk_ids, topk_weights):
        if self.expert is not None and layer == 0:
            hit = (topk_ids == self.expert).any(1)  # [T]
            if bool(hit.any()):
                err = ExpertServerError(
                    grpc.StatusCode.UNAVAILABLE, f"no live server holds layer 0 experts [{self.expert}]"
                )
                err.rows = tuple(hit.nonzero().flatten().tolist())
                raise err
        return self.inner.submit(layer, x, topk_ids, topk_weights)


def run_all(s, n=6):
    outs = [Collect() for _ in PROMPTS]
    for p, c in zip(PROMPTS, outs):
        s.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True), c)
    return [c.run() for c in outs]


def test_rows_map_to_the_requests_of_the_plan():
    plan = [("a", 3), ("b", 1), ("c", 4)]  # tokens 0-2, 3, 4-7; 8+ is padding
    assert _requests_of_rows(plan, (0, 2)) == {0}
    assert _requests_of_rows(plan, (3, 7, 9)) == {1, 2}
    assert _requests_of_rows(plan, None) == set() and _requests_of_rows(plan, ()) == set()


def test_only_requests_needing_a_lost_expert_fail(ckpt):  # noqa: F811
    s, flaky = make_scheduler(ckpt)
    lost = Lost(flaky.inner)
    s.engine.model.attach(lost)
    try:
        ref = [toks for toks, _ in run_all(s)]
        num_experts = s.engine.model.config.num_experts
        mixed = 0
        for e in range(num_experts):
            lost.expert = e
            got = run_all(s)
            lost.expert = None
            failed = [i for i, (_, last) in enumerate(got) if last.finish_reason == "error"]
            for i, (toks, last) in enumerate(got):
                if i in failed:
                    assert isinstance(last.error, ExpertServerError) and f"[{e}]" in str(last.error)
                else:
                    assert last.finish_reason == "length" and toks == ref[i], (e, i)
            assert s.stats()["free_pages"] == s.stats()["total_pages"]
            mixed += 0 < len(failed) < len(PROMPTS)
            if mixed >= 2:
                break
        assert mixed >= 2, "no expert split the requests into failed and served ones"
    finally:
        s.stop()
