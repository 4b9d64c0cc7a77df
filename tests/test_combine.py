"""Cross-stream batching with a meeting wait (expertmesh/worker/combine.py), without processes:
channel threads calling the worker core as the fast paths do, answers against the plain torch
reference computed per request, holds bounded by their deadline, a lone stream never held."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.worker import combine
from expertmesh.worker.config import WorkerConfig
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest

H, INTER, E = 8, 4, 4
LAYERS = [0, 1, 2, 3]


class Reader:
    """Random experts (seeded by layer and expert) over four MoE layers."""

    config = SimpleNamespace(hidden_size=H, moe_intermediate_size=INTER, moe_layer_ids=LAYERS, num_experts=E)

    def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
        g = torch.Generator().manual_seed(10 * layer + e)
        return SimpleNamespace(
            w13=torch.randn(2 * INTER, H, generator=g) * 0.3, w2=torch.randn(H, INTER, generator=g) * 0.3
        )


def make_worker(wait_us: float) -> ExpertWorker:
    slots = SlotTable(Reader(), torch.float32, torch.device("cpu"), E)  # type: ignore[arg-type]
    slots.preload(list(range(E)))
    return ExpertWorker(
        slots,
        TorchExpertBackend(),
        WorkerIdentity("cpu", "cpu", "host"),
        combine=True,
        combine_wait_us=wait_us,
    )


def request(layer: int, t: int, seed: int, bad: bool = False, **kw) -> ExpertRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (t, 2), generator=g, dtype=torch.int32)  # [T, K]
    if bad:
        ids = torch.full((t, 2), 7, dtype=torch.int32)  # slots this server does not have
    w = torch.rand(t, 2, generator=g)  # [T, K]
    return ExpertRequest(7, 0, layer, torch.randn(t, H, generator=g), ids, w, **kw)


def reference(worker: ExpertWorker, r: ExpertRequest) -> torch.Tensor:
    ls = worker.slots.live.layers[r.layer]
    return torch_moe(r.hidden, ls.w13, ls.w2, r.slot_ids, r.weights)  # [T, H]


class Stream(threading.Thread):
    """One coordinator's channel: its requests in order, each after ``before`` (its attention)."""

    def __init__(
        self,
        worker: ExpertWorker,
        reqs: list[ExpertRequest],
        before: Callable[[], object] = lambda: None,
        linger: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.worker, self.reqs, self.before = worker, reqs, before
        # NOTE: a stream is its channel's thread: one that ended may lend its id to the next
        self.linger = threading.Event() if linger else None
        self.outs: list[torch.Tensor] = []
        self.errs: list[BaseException | None] = []
        self.seconds: list[float] = []

    def run(self) -> None:
        for r in self.reqs:
            self.before()
            out = torch.full(r.hidden.shape, float("nan"))
            t0 = time.monotonic()
            try:
                self.worker.forward_into(r, out)
                self.errs.append(None)
            except errors.ExpertMeshError as e:
                self.errs.append(e)
            self.seconds.append(time.monotonic() - t0)
            self.outs.append(out)
        if self.linger is not None:
            self.linger.wait(10)


def steps(stream: int, n: int, t: int) -> list[ExpertRequest]:
    return [request(layer, t, 1000 * stream + 10 * s + layer) for s in range(n) for layer in LAYERS]


def run_streams(worker: ExpertWorker, delays: list[float], n_steps: int = 3) -> list[Stream]:
    """Streams of ``n_steps`` steps over every layer, stream i starting ``delays[i]`` late;
    each layer 3 ms of "attention" before its request."""
    streams = []
    for i, d in enumerate(delays):
        first = [True]

        def before(d: float = d, first: list[bool] = first) -> None:
            time.sleep(d if first[0] else 0.003)
            first[0] = False

        streams.append(Stream(worker, steps(i, n_steps, 2 + i), before))
    for s in streams:
        s.start()
    for s in streams:
        s.join(30)
        assert not s.is_alive()
    return streams


def wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_two_offset_streams_meet_after_a_hold_and_answer_as_computed_alone():
    # the second stream 2 ms behind: without a hold their requests for a layer rarely wait together
    calls = {}
    for wait_us in (0.0, 50_000.0):
        worker = make_worker(wait_us)
        streams = run_streams(worker, [0.0, 0.002])
        for s in streams:
            assert s.errs == [None] * len(s.reqs)
            for r, out in zip(s.reqs, s.outs):
                torch.testing.assert_close(out, reference(worker, r))
        n = sum(len(s.reqs) for s in streams)
        assert worker.stats.tokens == sum(r.tokens for s in streams for r in s.reqs)
        calls[wait_us] = worker.stats.requests
        c = worker.combiner
        assert c is not None
        if wait_us:
            # NOTE: once combined, both get their answers together and send the next layer close
            # together: nearly every later layer meets (the first may not)
            assert c.stats.combined >= n // 2, (c.stats, worker.stats.requests)
            assert c.stats.waits >= 1 and c.stats.met >= 1
        else:
            assert c.stats.waits == 0
    assert calls[50_000.0] < calls[0.0], calls  # rows per layer call rose


def test_a_lone_stream_is_never_held(monkeypatch):
    worker = make_worker(50_000.0)
    c = worker.combiner
    assert c is not None
    monkeypatch.setattr(c, "_hold", lambda *a, **k: pytest.fail("a lone stream was held"))
    # a stream whose requests can never share its batch (adapters, another top-k) is no other stream
    lora = request(1, 2, 5, adapter_slots=torch.full((2,), -1, dtype=torch.int32))
    g = request(0, 2, 8)
    k3 = ExpertRequest(7, 0, 0, g.hidden, torch.zeros(2, 3, dtype=torch.int32), torch.rand(2, 3))
    other = Stream(worker, [lora, k3], linger=True)
    other.start()
    wait_until(lambda: len(other.outs) == 2)
    streams = run_streams(worker, [0.0], n_steps=2)
    assert other.linger is not None
    other.linger.set()
    other.join(10)
    assert other.errs == [None, None] and streams[0].errs == [None] * 8
    assert c.stats.waits == 0 and c.stats.batches == 0 and worker.stats.requests == 10


def test_a_stream_idle_longer_than_the_window_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(combine, "ACTIVE_S", 0.05)
    worker = make_worker(50_000.0)
    c = worker.combiner
    assert c is not None
    run_streams(worker, [0.0], n_steps=1)  # a stream that then goes quiet, its last layer 3
    time.sleep(0.1)
    monkeypatch.setattr(c, "_hold", lambda *a, **k: pytest.fail("held for an idle stream"))
    run_streams(worker, [0.0], n_steps=1)
    assert c.stats.waits == 0


def test_a_hold_ends_at_its_deadline_when_the_awaited_stream_does_not_come():
    worker = make_worker(200_000.0)  # 0.2 s
    c = worker.combiner
    assert c is not None
    b = Stream(worker, [request(0, 2, 1)], linger=True)  # b's last layer: 0, so 1 is its next
    b.start()
    wait_until(lambda: len(b.outs) == 1)
    a = Stream(worker, [request(1, 3, 2)])
    a.start()
    a.join(10)
    assert b.linger is not None
    b.linger.set()
    b.join(10)
    assert a.errs == [None]
    torch.testing.assert_close(a.outs[0], reference(worker, a.reqs[0]))
    assert 0.19 <= a.seconds[0] < 2.0, a.seconds
    assert (c.stats.waits, c.stats.met) == (1, 0)
    assert 0.19 <= c.stats.wait_seconds < 2.0


def test_a_hold_ends_after_the_awaited_streams_usual_gap_between_requests():
    worker = make_worker(10_000_000.0)  # 10 s: the awaited stream's cadence ends the hold first
    c = worker.combiner
    assert c is not None
    b = Stream(worker, steps(1, 1, 2), lambda: time.sleep(0.02), linger=True)  # a request per 20 ms
    b.start()
    wait_until(lambda: len(b.outs) == len(LAYERS))  # its last layer: 3, so 0 is its next
    a = Stream(worker, [request(0, 3, 2)])
    a.start()
    a.join(10)
    assert b.linger is not None
    b.linger.set()
    b.join(10)
    assert a.errs == [None] and 0.015 <= a.seconds[0] < 2.0, a.seconds
    assert (c.stats.waits, c.stats.met) == (1, 0)


def test_a_hold_ends_when_the_awaited_stream_moves_past_the_layer():
    worker = make_worker(10_000_000.0)  # 10 s: only arrivals end these holds in time
    c = worker.combiner
    assert c is not None
    gate = threading.Event()
    # b sends layer 0, then (while a is held for it at layer 1) layer 2: none of its tokens went
    # to this server's experts at layer 1
    b = Stream(worker, [request(0, 2, 1), request(2, 2, 3)])
    b.before = lambda: gate.wait(10) if b.outs else None
    b.start()
    wait_until(lambda: len(b.outs) == 1)
    a_next = threading.Event()
    a = Stream(worker, [request(1, 3, 2), request(2, 3, 4)])
    a.before = lambda: a_next.wait(10) if a.outs else None
    a.start()
    wait_until(lambda: len(c._waiting) == 1)  # a held for b
    gate.set()
    wait_until(lambda: len(a.outs) == 1)  # b moved past layer 1: a's hold ended
    assert a.seconds[0] < 5.0, a.seconds
    a_next.set()  # b is held at layer 2 for a, whose layer 2 now comes
    a.join(10)
    b.join(10)
    assert a.errs == [None, None] and b.errs == [None, None]
    for s in (a, b):
        for r, out in zip(s.reqs, s.outs):
            torch.testing.assert_close(out, reference(worker, r))
    assert b.seconds[1] < 5.0, b.seconds
    assert (c.stats.waits, c.stats.met) == (2, 2)
    assert (c.stats.batches, c.stats.combined) == (1, 2)


def test_a_hold_ends_when_the_awaited_stream_sends_its_layer_with_adapters():
    worker = make_worker(10_000_000.0)
    c = worker.combiner
    assert c is not None
    gate = threading.Event()
    lora = request(1, 2, 3, adapter_slots=torch.full((2,), -1, dtype=torch.int32))  # never combined
    b = Stream(worker, [request(0, 2, 1), lora])
    b.before = lambda: gate.wait(10) if b.outs else None
    b.start()
    wait_until(lambda: len(b.outs) == 1)
    a = Stream(worker, [request(1, 3, 2)])
    a.start()
    wait_until(lambda: len(c._waiting) == 1)  # a held for b
    gate.set()
    a.join(10)
    b.join(10)
    assert a.errs == [None] and b.errs == [None, None] and a.seconds[0] < 5.0, a.seconds
    torch.testing.assert_close(a.outs[0], reference(worker, a.reqs[0]))
    assert (c.stats.waits, c.stats.met, c.stats.batches) == (1, 1, 0)


def test_a_bad_request_in_a_met_batch_fails_alone():
    worker = make_worker(10_000_000.0)  # 10 s: every hold here ends by an arrival
    c = worker.combiner
    assert c is not None
    gates = {name: threading.Event() for name in "bc"}
    streams = {}
    for name, seed, bad in (("b", 20, False), ("c", 30, True)):
        gate = gates[name]
        reqs = [request(0, 2, seed), request(1, 3, seed + 1, bad=bad)]
        s = Stream(worker, reqs)
        s.before = lambda s=s, gate=gate: gate.wait(10) if s.outs else None
        streams[name] = s
        s.start()
    wait_until(lambda: all(len(s.outs) == 1 for s in streams.values()))  # both last sent layer 0
    a = Stream(worker, [request(1, 4, 40)])
    a.start()
    wait_until(lambda: len(c._waiting) == 1)  # a held for b and c
    gates["b"].set()
    wait_until(lambda: len(c._waiting) == 2)  # b held for c (a already sent layer 1)
    gates["c"].set()  # c is awaited by nobody it waits for: it computes all three
    for s in (a, *streams.values()):
        s.join(10)
        assert not s.is_alive()
    b, bad = streams["b"], streams["c"]
    assert isinstance(bad.errs[1], errors.InvalidRequest) and a.errs == [None] and b.errs == [None, None]
    torch.testing.assert_close(a.outs[0], reference(worker, a.reqs[0]))
    torch.testing.assert_close(b.outs[1], reference(worker, b.reqs[1]))
    assert a.seconds[0] < 5.0 and b.seconds[1] < 5.0
    assert (c.stats.batches, c.stats.combined) == (1, 2)
    assert (c.stats.waits, c.stats.met) == (2, 2)
    assert worker.stats.errors == 1


def test_the_combine_metrics_are_exported():
    worker = make_worker(50_000.0)
    run_streams(worker, [0.0, 0.002], n_steps=2)
    st = worker.combiner.stats if worker.combiner is not None else None
    assert st is not None
    got = {}
    for fam in text_string_to_metric_families(generate_latest(worker.metrics.registry).decode()):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert got[("expertmesh_worker_combined_calls_total", ())] == st.batches
    assert got[("expertmesh_worker_combined_requests_total", ())] == st.combined
    assert got[("expertmesh_worker_combine_waits_total", (("outcome", "met"),))] == st.met
    assert got[("expertmesh_worker_combine_waits_total", (("outcome", "timed_out"),))] == st.waits - st.met
    assert got[("expertmesh_worker_combine_wait_seconds_total", ())] == pytest.approx(st.wait_seconds)


def test_the_wait_flag_is_validated():
    for bad in (-1.0, float("nan"), 2e6):
        with pytest.raises(ValueError, match="--combine-wait-us"):
            WorkerConfig(kind="gpu", model_dir="m", combine_streams=True, combine_wait_us=bad)
    with pytest.raises(ValueError):
        combine.StreamCombiner(make_worker(0.0), LAYERS, -5.0)  # type: ignore[arg-type]
