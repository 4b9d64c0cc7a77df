"""Decode steps queued one ahead (Scheduler.overlap): the next step is launched fed the last
step's samples before the host reads them. On the CPU every launch runs at once, so these tests
check the bookkeeping (positions, pages, finishing requests whose row the next step computed,
prefix indexing, a queued step that fails) against HF transformers; the CUDA path, where the
launch really queues, is tests/test_engine_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.cuda_graphs import Replayed
from coordinator.model.engine import Engine
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import Scheduler, SchedulerLimits
from tests.hf_models import make_checkpoint
from tests.serving_utils import (
    hf_greedy,
    one_thread,  # noqa: F401 (autouse fixture)
)
from tests.test_serving_scheduler import Collect

PROMPTS = [[3, 9, 4], [7, 1, 8, 2, 6], [5, 5, 11]]
OUT = [9, 4, 13]  # different lengths: requests finish while a step is queued behind them


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_overlap")
    hf = make_checkpoint("qwen3_moe", path, seed=3)
    refs = [hf_greedy(hf, p, n)[0] for p, n in zip(PROMPTS, OUT)]
    return path, refs


class EagerGraphs:
    """Stands in for the decode graphs on the CPU: a launch computes the step at once, eagerly,
    but the engine takes its graph path (pages, positions, tokens indexed when finished)."""

    extends = False

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def bucket(self, b: int) -> int:
        return b

    def launch(self, seqs, feed=None) -> Replayed:
        toks = feed.tolist() if feed is not None else [t for t, _, _ in seqs]
        batch = ForwardBatch.build(
            [([t], past, pages) for t, (_, past, pages) in zip(toks, seqs)],
            self.eng.page_size,
            self.eng.device,
        )
        return Replayed(self.eng.model(batch, self.eng.cache))

    def run(self, seqs) -> torch.Tensor:
        return self.launch(seqs).logits


def scheduler(path, overlap: bool, device: str = "cpu", graphs: bool = False, **limits) -> Scheduler:
    eng = Engine.from_checkpoint(str(path), num_pages=64, page_size=4, device=device)
    if graphs:
        eng.graphs = EagerGraphs(eng)  # type: ignore[assignment]
    kw = {"max_batch_tokens": 16, "max_running": 8, "max_context": 128, **limits}
    s = Scheduler(eng, SchedulerLimits(**kw))
    s.overlap = overlap
    return s


class Counting:
    """Wraps Engine.launch: counts queued launches; ``fail`` makes the finish of the n-th launch
    report a failed step (as a linked step whose error word is set does)."""

    def __init__(self, eng: Engine, fail: int | None = None) -> None:
        self.eng, self.fail, self.launches, self.fed = eng, fail, 0, 0
        self._launch = eng.launch
        eng.launch = self  # type: ignore[method-assign]

    def __call__(self, items, feed=None):
        run = self._launch(items, feed)
        self.launches += 1
        self.fed += feed is not None
        if self.launches == self.fail:
            run.step = Replayed(run.logits, lambda: False)
        return run


def next_turn(s: Scheduler, prompt: list[int]):
    """``prompt`` decoded for 11 tokens, then its whole text as a new request's prompt for 6
    more: (first tokens, that text, the new tokens, the new request's last Output)."""
    first = run_all(s, [prompt], [11])[0]
    text = prompt + first
    c = Collect()
    s.submit(text, SamplingParams(max_new_tokens=6, ignore_eos=True), c)
    toks, last = c.run()
    return first, text, toks, last


def run_all(s: Scheduler, prompts, outs, **params) -> list[list[int]]:
    cs = []
    for p, n in zip(prompts, outs):
        c = Collect()
        s.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **params), c)
        cs.append(c)
    return [c.run()[0] for c in cs]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
def test_queued_steps_match_hf_and_free_every_page(model, graphs):
    path, refs = model
    s = scheduler(path, overlap=True, graphs=graphs)
    n = Counting(s.engine)
    s.start()
    try:
        got = run_all(s, PROMPTS, OUT)
        assert got == refs
        assert n.fed > 0  # steps were fed the samples of the step before them
        st = s.stats()
        assert st["running"] == 0 and st["queued_steps"] == n.fed and st["queued_failures"] == 0
    finally:
        s.stop()
    assert s.engine.pages.num_free == s.engine.pages.num_pages
    assert not s.engine.seqs


def test_sampling_draws_as_without_overlap(model):
    path, _ = model
    outs = {}
    for overlap in (False, True):
        s = scheduler(path, overlap=overlap)
        s.start()
        try:
            outs[overlap] = run_all(s, PROMPTS, OUT, temperature=0.8, top_p=0.9, seed=11)
        finally:
            s.stop()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
def test_eos_and_stop_while_a_step_is_queued(model, graphs):
    path, refs = model
    eos = refs[2][4]  # request 2 stops at its 5th token; the others run on
    s = scheduler(path, overlap=True, graphs=graphs)
    s.eos_ids = frozenset({eos})
    s.start()
    try:
        cs = []
        for p, n in zip(PROMPTS, OUT):
            c = Collect()
            s.submit(p, SamplingParams(max_new_tokens=n), c)
            cs.append(c)
        got = [c.run() for c in cs]
    finally:
        s.stop()
    for (toks, last), ref in zip(got, refs):
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert toks == want
        assert last.finish_reason == ("stop" if eos in ref else "length")
    assert s.engine.pages.num_free == s.engine.pages.num_pages


def test_a_failed_queued_step_runs_again(model):
    """The failed step and the one fed by it run again: greedy tokens as HF's, and a seeded
    request draws as it does when nothing fails (its generator is put back). Only a graph step
    can fail after its launch (a linked step's error word), so only the graph path is tried."""
    path, refs = model
    graphs = True
    s = scheduler(path, overlap=True, graphs=graphs)
    n = Counting(s.engine, fail=3)  # a step whose successor was queued fed with its samples
    s.start()
    try:
        got = run_all(s, PROMPTS[:1], OUT[:1])
    finally:
        s.stop()
    assert got == refs[:1]
    assert n.launches > OUT[0] - 1  # the failed step and the one fed by it ran again
    assert s.stats()["queued_failures"] == 1
    assert s.engine.pages.num_free == s.engine.pages.num_pages
    s = scheduler(path, overlap=True, graphs=graphs)
    Counting(s.engine, fail=3)
    s.start()
    try:
        seeded = run_all(s, PROMPTS[1:2], [9], temperature=0.9, seed=5)
    finally:
        s.stop()
    assert s.stats()["queued_failures"] == 1
    clean = scheduler(path, overlap=False)
    clean.start()
    try:
        assert seeded == run_all(clean, PROMPTS[1:2], [9], temperature=0.9, seed=5)
    finally:
        clean.stop()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
def test_prefix_index_holds_the_tokens_of_queued_steps(model, graphs):
    """The pages a queued run filled enter the prefix index with the right tokens: a request
    whose prompt is the first request's whole text gets them cached and decodes as HF does."""
    path, _ = model
    hf_prompt = PROMPTS[1]
    s = scheduler(path, overlap=True, graphs=graphs)
    s.start()
    try:
        first, text, toks, last = next_turn(s, hf_prompt)
    finally:
        s.stop()
    assert last.cached_tokens >= 12  # whole pages of the first request's prompt and samples
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert toks == hf_greedy(hf, text, 6)[0]


def test_cancel_and_a_new_request_drain_the_queue(model):
    path, refs = model
    s = scheduler(path, overlap=True)
    s.start()
    try:
        c0 = Collect()
        rid = s.submit(PROMPTS[0], SamplingParams(max_new_tokens=60, ignore_eos=True), c0)
        first = c0.q.get(timeout=30)  # decoding (steps queued) by now
        assert first.token_ids
        c1 = Collect()
        s.submit(PROMPTS[1], SamplingParams(max_new_tokens=OUT[1], ignore_eos=True), c1)
        s.cancel(rid)
        toks, last = c1.run()
        assert toks == refs[1]
        while True:
            out = c0.q.get(timeout=30)
            if out.finish_reason is not None:
                break
        assert out.finish_reason == "cancelled"
    finally:
        s.stop()
    assert s.engine.pages.num_free == s.engine.pages.num_pages


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model[0], torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
def test_context_limit_and_page_pressure_while_queued(model, hf, graphs):
    """Requests that reach the context limit end at it (a queued step's row past it is
    dropped), and a streak that runs short of pages reads its step back and preempts as the
    synchronous path does: tokens as HF's, every page back."""
    path, refs = model
    s = scheduler(path, overlap=True, graphs=graphs, max_context=11)
    s.start()
    try:
        got = run_all(s, PROMPTS, [20, 20, 20])
    finally:
        s.stop()
    assert got == [hf_greedy(hf, p, 11 - len(p))[0] for p in PROMPTS]
    assert s.engine.pages.num_free == s.engine.pages.num_pages
    # 5 pages of 4 rows: the three requests (prompts 3-5, 4-13 new tokens) cannot all keep
    # theirs, so the newest is preempted and recomputed mid-run
    eng = Engine.from_checkpoint(str(path), num_pages=5, page_size=4)
    if graphs:
        eng.graphs = EagerGraphs(eng)  # type: ignore[assignment]
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=16, max_running=8, max_context=16))
    s.overlap = True
    s.start()
    try:
        got = run_all(s, PROMPTS, OUT)
    finally:
        s.stop()
    assert got == refs
    assert s.num_preemptions > 0
    assert eng.pages.num_free == eng.pages.num_pages


class Slow:
    """Wraps Engine.launch and Engine.step: each step takes at least ``s`` seconds."""

    def __init__(self, eng: Engine, s: float) -> None:
        import time

        for name in ("launch", "step"):
            inner = getattr(eng, name)

            def slow(*a, _inner=inner, **kw):
                time.sleep(s)
                return _inner(*a, **kw)

            setattr(eng, name, slow)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
def test_a_deadline_while_queued_fails_only_its_request(model, graphs):
    import time

    path, refs = model
    s = scheduler(path, overlap=True, graphs=graphs)
    Slow(s.engine, 0.01)
    s.start()
    try:
        c0, c1 = Collect(), Collect()
        s.submit(
            PROMPTS[0],
            SamplingParams(max_new_tokens=100, ignore_eos=True),
            c0,
            deadline=time.monotonic() + 0.3,
        )
        s.submit(PROMPTS[2], SamplingParams(max_new_tokens=OUT[2], ignore_eos=True), c1)
        toks0, last0 = c0.run()
        toks1, _ = c1.run()
    finally:
        s.stop()
    assert last0.finish_reason == "error" and "deadline" in str(last0.error)
    assert toks1 == refs[2]
    assert s.engine.pages.num_free == s.engine.pages.num_pages
