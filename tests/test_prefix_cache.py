"""Prefix caching through the scheduler: with the cache on, every request gets the greedy tokens
and log-probabilities of the same request with ``prefix_cache=False`` (the reference: the
engine computing every token itself, which tests/test_parity.py holds against HF), while its
usage says how much of the prompt came from the cache."""

from __future__ import annotations

import queue
import random

import grpc
import pytest

from coordinator.experts.remote import ExpertServerError
from coordinator.model.dispatch import Dispatcher
from coordinator.model.engine import Engine
from coordinator.serving.outputs import Output
from coordinator.serving.sampler import SamplingParams
from coordinator.serving.scheduler import Scheduler, SchedulerLimits
from tests.hf_models import ARCHS, make_checkpoint
from tests.serving_utils import one_thread  # noqa: F401 (autouse fixture)

P = 4  # page size
NEW = 6  # tokens generated per request
LP_TOL = 2e-5  # logprobs: the prefix's K/V came from other steps (other batch shapes)
GPU_LP_TOL = 2e-3  # CUDA kernels pick tiles by batch shape: their float32 sums run in other orders


class Result:
    def __init__(self) -> None:
        self.q: queue.Queue[Output] = queue.Queue()

    def __call__(self, out: Output) -> None:
        self.q.put(out)

    def get(self) -> tuple[list[int], list[float], Output]:
        toks: list[int] = []
        lps: list[float] = []
        while True:
            out = self.q.get(timeout=60)
            toks += out.token_ids
            lps += out.logprobs
            if out.finish_reason is not None:
                return toks, lps, out


def scheduler(
    ckpt, prefix: bool, num_pages: int = 64, batch: int = 16, setup=None, device="cpu"
) -> Scheduler:
    eng = Engine.from_checkpoint(
        str(ckpt), device=device, num_pages=num_pages, page_size=P, prefix_cache=prefix
    )
    if setup is not None:
        setup(eng)
    s = Scheduler(eng, SchedulerLimits(max_batch_tokens=batch, max_running=8, max_context=num_pages * P))
    s.start()
    return s


def submit(s: Scheduler, prompt: list[int], lora: str | None = None) -> Result:
    r = Result()
    s.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=True), r, lora=lora)
    return r


def run(s: Scheduler, prompt: list[int], lora: str | None = None) -> tuple[list[int], list[float], Output]:
    return submit(s, prompt, lora).get()


def same(got, ref, tol: float = LP_TOL) -> None:
    (toks, lps, out), (rtoks, rlps, rout) = got, ref
    assert out.error is None and rout.error is None, (out.error, rout.error)
    assert toks == rtoks
    assert max(abs(a - b) for a, b in zip(lps, rlps)) < tol


def rand(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(96) for _ in range(n)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_qwen3")
    make_checkpoint("qwen3_moe", path, seed=3)
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_matches_recompute(arch, tmp_path):
    """Repeated prompts, a prompt extending an earlier request's prompt and reply (a chat turn),
    one diverging inside a page, and a prompt of whole pages (its last page is recomputed)."""
    make_checkpoint(arch, tmp_path)
    base, whole = rand(22, 1), rand(16, 2)
    cache, ref = scheduler(tmp_path, True), scheduler(tmp_path, False)
    try:
        first = run(cache, base)
        same(first, run(ref, base))
        turn = base + first[0] + rand(5, 3)
        # prompt -> pages expected from the cache: 22 tokens hold 5 full pages; the reply's K/V
        # (22 + 5 fed-back tokens) fills a 6th; a divergence at token 14 keeps pages 0..2; 16
        # tokens are 4 pages, the last recomputed for the last token's logits
        cases = [(base, 5), (turn, 6), (base[:14] + rand(7, 4), 3), (whole, 0), (whole, 3)]
        for prompt, pages in cases:
            got, want = run(cache, prompt), run(ref, prompt)
            same(got, want)
            assert (got[2].cached_tokens, want[2].cached_tokens) == (pages * P, 0)
            assert got[2].prompt_tokens == len(prompt)
        assert cache.engine.prefix is not None and cache.engine.prefix.num_pages > 0
    finally:
        cache.stop()
        ref.stop()


def test_concurrent_requests_racing_for_one_prefix(qwen):
    """Requests sharing a prefix arrive together: later ones take the pages an earlier one is
    still prefilling (the step budget spreads prefill over steps), then all again on a warm cache."""
    base = rand(21, 5)
    prompts = [base + [t] for t in (1, 2, 3)] + [base, base[:9] + rand(12, 6)]
    cache, ref = scheduler(qwen, True), scheduler(qwen, False)
    try:
        want = [run(ref, p) for p in prompts]
        for _ in range(2):
            got = [r.get() for r in [submit(cache, p) for p in prompts]]
            for g, w in zip(got, want):
                same(g, w)
        assert any(g[2].cached_tokens for g in got)
    finally:
        cache.stop()
        ref.stop()


def test_eviction_under_a_small_kv_budget(qwen):
    """Ten pages: cached pages fill them and are evicted as requests need room; none fails,
    also not a request that needs nearly every page while the cache holds all of them."""
    prompts = [rand(14, 10 + i) for i in range(6)]
    cache, ref = scheduler(qwen, True, num_pages=10), scheduler(qwen, False)
    try:
        for p in prompts:
            same(run(cache, p), run(ref, p))
        assert cache.engine.pages.num_kept > 0 and cache.engine.pages.num_free == 10
        got = [r.get() for r in [submit(cache, p) for p in prompts[:4]]]  # preempts, evicts
        for g, p in zip(got, prompts[:4]):
            same(g, run(ref, p))
        big = rand(33, 20)  # 33 + 6 tokens: all 10 pages
        same(run(cache, big), run(ref, big))
        assert cache.engine.prefix is not None and cache.engine.prefix.num_pages <= 10
        for p in prompts:  # the cache still serves what survived, correctly
            same(run(cache, p), run(ref, p))
    finally:
        cache.stop()
        ref.stop()


class Hook(Dispatcher):
    """Delegates to the real dispatcher; ``on_layer0`` runs before each step's first MoE layer
    and may raise instead (as an expert server failure does)."""

    def __init__(self, inner: Dispatcher, first_moe_layer: int) -> None:
        self.inner, self.first, self.steps = inner, first_moe_layer, 0
        self.on_layer0 = lambda hook, topk_ids: None

    def submit(self, layer, x, topk_ids, topk_weights):
        if layer == self.first:
            self.steps += 1
            self.on_layer0(self, topk_ids)
        return self.inner.submit(layer, x, topk_ids, topk_weights)


def hooked(eng: Engine) -> None:
    eng.model.attach(Hook(eng.dispatcher, eng.config.moe_layer_ids[0]))


def test_cancel_mid_prefill_leaves_only_whole_pages(qwen):
    """Cancelled after 3 prefill chunks of 6 tokens: pages 0..3 are whole and stay cached, the
    half-written 5th page is dropped; the prompt again reuses exactly those 16 tokens."""
    prompt = rand(30, 7)
    cache, ref = scheduler(qwen, True, batch=6, setup=hooked), scheduler(qwen, False)
    try:
        hook = cache.engine.model.dispatcher
        assert isinstance(hook, Hook)
        rid: list[int] = []

        def cancel_after_third(h, _ids):
            if h.steps == 3:
                cache.cancel(rid[0])  # taken between this step and the next

        hook.on_layer0 = cancel_after_third
        r = Result()
        rid.append(cache.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True), r))
        assert r.get()[2].finish_reason == "cancelled"
        hook.on_layer0 = lambda h, i: None
        got = run(cache, prompt)
        same(got, run(ref, prompt))
        assert got[2].cached_tokens == 16
    finally:
        cache.stop()
        ref.stop()


def test_failed_steps_leave_shared_pages_intact(qwen):
    """A step that fails (an expert server lost) and a step re-run for the requests an error
    did not hit, both over pages shared from the cache: later requests still match recompute."""
    base = rand(20, 8)
    a, b = base + rand(3, 9), base + rand(5, 10)
    cache, ref = scheduler(qwen, True, setup=hooked), scheduler(qwen, False)
    try:
        hook = cache.engine.model.dispatcher
        assert isinstance(hook, Hook)
        run(cache, base)

        def fail_once(h, ids):
            h.on_layer0 = lambda h, i: None
            err = ExpertServerError(grpc.StatusCode.UNAVAILABLE, "cpu0: stream closed")
            err.rows = (ids.shape[0] - 1,)  # the step's last token: b's, not a's
            raise err

        hook.on_layer0 = fail_once
        ra, rb = submit(cache, a), submit(cache, b)
        same(ra.get(), run(ref, a))
        assert isinstance(rb.get()[2].error, ExpertServerError)

        def fail_all(h, ids):
            h.on_layer0 = lambda h, i: None
            raise ExpertServerError(grpc.StatusCode.UNAVAILABLE, "cpu0: stream closed")

        hook.on_layer0 = fail_all
        assert isinstance(run(cache, b)[2].error, ExpertServerError)
        for p, pages in ((b, 5), (a, 5), (base, 4)):  # base: whole pages, the last recomputed
            got = run(cache, p)
            same(got, run(ref, p))
            assert got[2].cached_tokens == pages * P
    finally:
        cache.stop()
        ref.stop()


def test_adapters_never_share_kv(tmp_path):
    """The same prompt under an adapter, then the base model, then the adapter again, then the
    adapter unloaded and loaded again under its name: only the adapter's own repeat reuses."""
    from coordinator.lora import enable_lora
    from tests import lora_utils

    hf = lora_utils.make_model("qwen3_moe", tmp_path / "m")
    path = str(lora_utils.save(lora_utils.wrap(hf), tmp_path / "a"))

    def with_lora(eng: Engine) -> None:
        enable_lora(eng, max_loras=2).load("a", path)

    prompt = rand(18, 11)
    cache, ref = (
        scheduler(tmp_path / "m", True, setup=with_lora),
        scheduler(tmp_path / "m", False, setup=with_lora),
    )
    try:
        lora = cache.engine.lora
        assert lora is not None
        adapted, plain = run(ref, prompt, "a"), run(ref, prompt)
        assert adapted[0] != plain[0]  # the adapter changes the answer: sharing would show
        for name, want, pages in (("a", adapted, 0), (None, plain, 0), ("a", adapted, 4), (None, plain, 4)):
            got = run(cache, prompt, name)
            same(got, want)
            assert got[2].cached_tokens == pages * P
        cache.call_between_steps(lambda: (lora.unload("a"), lora.load("a", path))).result()
        got = run(cache, prompt, "a")
        same(got, adapted)
        assert got[2].cached_tokens == 0
    finally:
        cache.stop()
        ref.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_cuda_graph_decode_over_shared_pages(arch, tmp_path):
    """On CUDA (paged-attention / MLA kernels, decode replayed from CUDA graphs): requests
    decoding together over pages they share give the tokens of the same requests without the
    cache (float32; the kernels' sums run in another order for other batch shapes)."""
    make_checkpoint(arch, tmp_path)
    base = rand(22, 12)
    prompts = [base, base + rand(3, 13), base[:10] + rand(9, 14), base + rand(8, 15)]
    cache = scheduler(tmp_path, True, device="cuda")
    ref = scheduler(tmp_path, False, device="cuda")
    try:
        assert cache.engine.graphs is not None
        want = [run(ref, p) for p in prompts]
        same(run(cache, base), want[0], tol=GPU_LP_TOL)
        got = [r.get() for r in [submit(cache, p) for p in prompts]]  # one decode batch
        for g, w in zip(got, want):
            same(g, w, tol=GPU_LP_TOL)
        assert [g[2].cached_tokens for g in got] == [20, 20, 8, 20]
    finally:
        cache.stop()
        ref.stop()


def test_a_recomputed_block_takes_the_indexed_page_and_indexing_goes_on(qwen):
    """A prompt of whole pages recomputes its last page, whose block another request indexed
    already: the sequence takes that page and indexes its own reply after it, so a next turn
    built on that reply finds it cached (before, indexing stopped at the duplicate)."""
    whole = rand(4 * P, 7)
    cache, ref = scheduler(qwen, True), scheduler(qwen, False)

    def go(s: Scheduler, prompt: list[int], n: int) -> tuple[list[int], list[float], Output]:
        r = Result()
        s.submit(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True), r)
        return r.get()

    try:
        same(go(cache, whole, 2), go(ref, whole, 2))  # indexes the prompt's 4 pages
        second = go(cache, whole, 2 * P + 1)  # matches 3, recomputes the 4th: a duplicate block
        same(second, go(ref, whole, 2 * P + 1))
        assert second[2].cached_tokens == 3 * P
        turn = whole + second[0][: 2 * P] + [5]
        got = go(cache, turn, 3)
        same(got, go(ref, turn, 3))
        assert got[2].cached_tokens == 6 * P  # the prompt's 4 pages and the second reply's 2
    finally:
        cache.stop()
        ref.stop()
    eng = cache.engine
    assert eng.pages.num_free == eng.pages.num_pages
