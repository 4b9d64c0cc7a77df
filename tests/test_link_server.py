"""The expert server's side of the device link: without a GPU, the refusal
paths (a LinkStep for an unknown bucket, another generation, while draining, on a channel
without a link; a malformed one ends the channel, a refused one does not), the Ack's
``link_reason``, the worker's stats, and one linked layer's work (routing taken with bad ids
made -1, the MoE against a float64 reference, flags, the timeout) under the Triton
interpreter. On a GPU (``gpu``): the step graph driven by a fake coordinator on a second
stream of the same process."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link, segment
from expertmesh.transport.client import ShmClient
from expertmesh.transport.handshake import Hello
from expertmesh.transport.layout import REQUESTS_WORD, header_words
from expertmesh.transport.server import ShmServer, link_refusal
from expertmesh.worker.config import WorkerConfig, link_mode
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest
from gpu_server.link_graphs import LinkGraphs, StepInputs, StepReport, Words, run_layer, take_route
from tests.test_slots import FakeReader, H

# the interpreter without CUDA, the compiled kernels on the device machine
DEV = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def reference_moe(x, w13, w2, ids, w) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * w2[s] @ (silu(w13[s, :I] x[t]) * w13[s, I:] x[t]), s = ids[t, k],
    in float64; ids -1 skipped."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            s = int(ids[t, k])
            if s < 0:
                continue
            gu = w13[s].double() @ x64[t]
            out[t] += float(w[t, k]) * (w2[s].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


# ---------------------------------------------------------------------- accepting the link


@pytest.mark.parametrize(
    "mode, same_gpu, host, words",
    [
        ("off", False, True, "EXPERTMESH_LINK=0"),
        ("auto", False, False, "no step graphs"),
        ("auto", True, True, "time-slice"),
        ("force", True, True, ""),
        ("auto", False, True, ""),
    ],
)
def test_link_is_taken_between_two_gpus_or_when_forced(mode, same_gpu, host, words):
    why = link_refusal(mode, same_gpu, host)
    assert (why == "") == (words == "") and words in why


def test_link_mode_comes_from_the_environment_and_is_validated():
    assert [link_mode(v) for v in ("", "1", "0", "force", " FORCE ")] == [
        "auto",
        "auto",
        "off",
        "force",
        "force",
    ]
    with pytest.raises(ValueError, match="EXPERTMESH_LINK"):
        link_mode("yes please")
    with pytest.raises(ValueError, match="device link mode"):
        WorkerConfig(kind="gpu", model_dir="m", link="sometimes")


def _server(link_host=None, mode="auto") -> ShmServer:
    hello = Hello("shm", f"expertmesh-1-2-{'ab' * 8}", 8192, 4096, 4096, "0" * 32)
    # NOTE: the GPU where there is one: the link is only offered to a cuda_ipc channel
    return ShmServer(hello, DEV, lambda r: r.hidden, link=link_host, link_mode=mode)


@pytest.mark.parametrize(
    "mode, same_gpu, words",
    [
        ("off", False, "off on this server"),
        ("auto", True, "time-slice"),
        # forced, but the handle maps nothing (no CUDA driver here, or not an IPC handle)
        ("force", True, "could not be set up"),
    ],
)
def test_ack_says_why_there_is_no_link(worker, mode, same_gpu, words):
    offer = {"area": {"handle": "11" * 64, "offset": 0, "nbytes": 4096}, "rows": 4, "top_k": 2}
    server = _server(worker, mode)
    ack = server._open_link(offer, same_gpu)
    assert set(ack) == {"link_reason"} and words in ack["link_reason"]
    assert server._link is None


# ---------------------------------------------------------------------- one linked layer


def _areas(rows, hidden, top_k, dtype=torch.float32):
    cpu = DEV
    req = link.RequestViews.of(
        link.new_area(link.request_bytes(rows, hidden, top_k, dtype), cpu), rows, hidden, top_k, dtype
    )
    ans = link.AnswerViews.of(link.new_area(link.answer_bytes(rows, hidden, dtype), cpu), rows, hidden, dtype)
    return req, ans


def test_take_route_makes_bad_ids_minus_one_and_says_so():
    src = torch.tensor([[0, 3], [-1, 4], [-7, 2], [1, 1]], dtype=torch.int32, device=DEV)
    w = torch.rand(4, 2, device=DEV)
    ids, ws = torch.zeros(4, 2, dtype=torch.int32, device=DEV), torch.zeros(4, 2, device=DEV)
    err = torch.zeros(1, dtype=torch.int64, device=DEV)
    status = torch.full((1,), 99, dtype=torch.int64, device=DEV)
    counts = torch.zeros(6, dtype=torch.int64, device=DEV)  # S' = 5 >= S = 4
    xs = torch.randn(4, 3000, device=DEV).to(torch.bfloat16)  # > one XBLOCK: two copy programs
    x = torch.zeros_like(xs)
    take_route(src, w, 4, ids, ws, err, status, counts, xs, x)
    assert torch.equal(x, xs)
    assert ids.tolist() == [[0, 3], [-1, -1], [-1, 2], [1, 1]]  # 4 >= S and -7 < -1 are bad
    assert torch.equal(ws, w) and int(err) == link.ERR_BAD_SLOT and int(status) == link.ERR_BAD_SLOT
    assert counts.tolist() == [3, 1, 2, 1, 1, 0]  # [-1 pairs, slot 0, 1, 2, 3, 4]
    # good ids: nothing added to the errors word, the status repeats it (the step's bits so far)
    err.fill_(link.ERR_TIMEOUT)
    take_route(
        src.clamp(-1, 3), w, 4, ids, ws, err, status, counts, xs[:, :5].contiguous(), x[:, :5].contiguous()
    )
    assert int(err) == link.ERR_TIMEOUT and int(status) == link.ERR_TIMEOUT


def test_a_linked_layer_waits_computes_and_signals():
    """run_layer (the step graph's content) eagerly, with the torch backend: the interpreter's
    wait/signal without CUDA; against a float64 reference."""
    g = torch.Generator().manual_seed(0)
    rows, tb, hidden, inter, k, s = 4, 2, 8, 4, 2, 3
    w13, w2 = torch.randn(s, 2 * inter, hidden, generator=g), torch.randn(s, hidden, inter, generator=g)
    req, ans = _areas(rows, hidden, k)
    step = torch.tensor([7], dtype=torch.int64, device=DEV)
    words = Words(step, torch.full((1,), -1, dtype=torch.int64, device=DEV), torch.zeros_like(step))
    st = StepInputs.new(tb, hidden, k, torch.float32, DEV)
    counts = torch.zeros(s + 1, dtype=torch.int64, device=DEV)
    # the coordinator's side: layer 1's request, then its flag
    x = torch.randn(tb, hidden, generator=g)
    ids = torch.tensor([[2, 0], [5, -1]], dtype=torch.int32)  # 5: not a slot of this layer
    wts = torch.rand(tb, k, generator=g)
    req.x[:tb], req.ids[:tb], req.w[:tb] = x.to(DEV), ids.to(DEV), wts.to(DEV)
    req.ids[tb:] = 1  # rows past the bucket are never read
    link.signal(req.flag, step, 1)
    moe = TorchExpertBackend()
    w13d, w2d = w13.to(DEV), w2.to(DEV)
    run_layer(moe, req, ans, words, 1, w13d, w2d, st, counts, 1.0, max_polls=100)
    clean = torch.tensor([[2, 0], [-1, -1]], dtype=torch.int32)
    torch.testing.assert_close(
        ans.out[:tb].cpu().double(), reference_moe(x, w13, w2, clean, wts), rtol=1e-5, atol=1e-5
    )
    assert int(ans.flag) == 7 * link.STEP_SPAN + 1 + 1
    assert int(ans.status) == link.ERR_BAD_SLOT and int(words.abort) == -1
    assert counts.tolist() == [2, 1, 0, 1]
    # layer 2's flag never comes: the wait times out, the layer runs through and answers
    run_layer(moe, req, ans, words, 2, w13d, w2d, st, counts, 0.05, max_polls=5)
    assert int(words.abort) == 7 and int(ans.status) == link.ERR_BAD_SLOT | link.ERR_TIMEOUT
    assert int(ans.flag) == 7 * link.STEP_SPAN + 2 + 1


# ---------------------------------------------------------------------- the worker's link step


@pytest.fixture
def worker() -> ExpertWorker:
    slots = SlotTable(FakeReader(), torch.float32, torch.device("cpu"), 4)  # type: ignore[arg-type]
    slots.preload([0, 1, 2, 3])
    return ExpertWorker(slots, TorchExpertBackend(), WorkerIdentity("gpu", "cpu", "host"))


class CpuLink(LinkGraphs):
    """The real link checks and bookkeeping; the launch (a CUDA graph) recorded instead."""

    def __init__(self, rows: int = 8, top_k: int = 2) -> None:
        area = link.new_area(link.request_bytes(rows, H, top_k, torch.float32), torch.device("cpu"))
        super().__init__(TorchExpertBackend(), area, rows, H, top_k, torch.float32, (1, 2, 4, 8, 16))
        self.launched: list[tuple] = []
        self.reports: list[StepReport] = []

    def launch(self, generation, weights, bucket, step, rows, timeout_ms, micro=1):
        self.check(bucket, step, timeout_ms, micro)
        shapes = [tuple(w13.shape) for w13, _ in weights]
        self.launched.append((generation, shapes, bucket, step, rows) + ((micro,) if micro > 1 else ()))
        self.last_step = step
        return None  # the last step's report was collected before (collect())

    def collect(self):
        return self.reports.pop(0) if self.reports else None

    def close(self):
        return self.collect()


def _step(**kw) -> dsc.LinkStep:
    return dsc.LinkStep(**{**dict(seq=1, step=1, rows=3, bucket=4, generation=0, timeout_ms=1000), **kw})


def test_link_step_launches_every_moe_layer_and_counts(worker, caplog):
    graphs = CpuLink()
    assert graphs.buckets == (1, 2, 4, 8) and graphs.answer.numel() == link.answer_bytes(8, H, torch.float32)
    worker.link_step(graphs, _step())
    assert graphs.launched == [(0, [(4, 4, H), (4, 4, H)], 4, 1, 3)]  # layers 0 and 2, model order
    assert (worker.stats.requests, worker.stats.tokens, worker.stats.errors) == (2, 6, 0)
    # the next step brings the last one's report: token counts folded, a timeout logged once
    c0, c2 = np.array([1, 0, 2, 0]), np.array([0, 3, 0, 0])
    graphs.reports = [StepReport(1, link.ERR_TIMEOUT, [c0, c2]), StepReport(2, link.ERR_TIMEOUT, [c0, c2])]
    with caplog.at_level(logging.WARNING, "expertmesh.worker"):
        worker.link_step(graphs, _step(step=2))
        worker.link_step(graphs, _step(step=3))
    assert worker.tokens_per_slot[0].tolist() == [2, 0, 4, 0] and worker.tokens_per_slot[2].tolist() == [
        0,
        6,
        0,
        0,
    ]
    assert worker.stats.errors == 2 and worker.stats.requests == 6
    assert sum("did not signal" in r.message for r in caplog.records) == 1
    graphs.reports = [StepReport(3, link.ERR_BAD_SLOT, [c0, c2])]
    worker.close_link(graphs)
    assert worker.stats.errors == 3 and worker.tokens_per_slot[0].tolist() == [3, 0, 6, 0]


def test_a_micro_batched_step_runs_on_a_relayed_link_only(worker):
    graphs = CpuLink()
    with pytest.raises(errors.InvalidRequest, match="relayed link only"):
        worker.link_step(graphs, _step(micro=2))
    graphs.relayed = True  # as the worker's open_link sets it for a relay's areas
    worker.link_step(graphs, _step(micro=2))
    # two micro-batches of 2 rows: the graphs' bucket of one; 2 real rows in the first
    assert graphs.launched == [(0, [(4, 4, H), (4, 4, H)], 2, 1, 2, 2)]
    assert worker.stats.tokens == 6  # the step's 3 real rows x 2 MoE layers
    with pytest.raises(errors.InvalidRequest, match="not one of this link's buckets"):
        worker.link_step(graphs, _step(step=2, bucket=16, rows=9, micro=1))  # 16 > the areas' 8 rows


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (dict(bucket=3), errors.InvalidRequest, "not one of this link's buckets"),
        (dict(bucket=16, rows=16), errors.InvalidRequest, "not one of this link's buckets"),  # > R
        (dict(generation=5), errors.StaleGeneration, "not the live generation"),
        (dict(step=0), errors.InvalidRequest, "steps must increase"),
        (dict(timeout_ms=0), errors.InvalidRequest, "timeout"),
    ],
)
def test_link_step_refusals(worker, kw, err, words):
    graphs = CpuLink()
    worker.link_step(graphs, _step(step=1))
    with pytest.raises(err, match=words):
        worker.link_step(graphs, _step(**{"step": 2, **kw}))
    assert len(graphs.launched) == 1 and worker.stats.errors == 1


def test_link_step_refused_while_draining_or_broken(worker):
    graphs = CpuLink()
    worker.start_drain("draining: SIGTERM")
    with pytest.raises(errors.Unavailable, match="SIGTERM"):
        worker.link_step(graphs, _step())
    worker.draining = worker.refusing = ""
    graphs.broken = "the step graph could not be captured: out of memory"
    with pytest.raises(errors.Unavailable, match="out of memory"):
        worker.link_step(graphs, _step())
    assert graphs.launched == []


def test_backend_without_step_graphs_refuses_the_link(worker):
    area = link.new_area(link.request_bytes(4, H, 2, torch.float32), torch.device("cpu"))
    with pytest.raises(errors.Incompatible, match="no CUDA graphs"):
        worker.open_link(area, 4, 2)


def test_an_area_too_small_for_its_offer_is_refused():
    area = link.new_area(link.request_bytes(4, H, 2, torch.float32), torch.device("cpu"))
    with pytest.raises(ValueError, match="request area holds"):
        LinkGraphs(TorchExpertBackend(), area, 64, H, 2, torch.float32, (1, 2, 4))


# ---------------------------------------------------------------------- the channel


def _post(client: ShmClient, raw: bytes) -> dsc.Response:
    """Writes one descriptor and reads one response (the client's FIFOs, bypassing its
    bookkeeping: the coordinator's link side is not this test's)."""
    os.write(client._req_fd, raw)
    client._sent = (client._sent + 1) & 0xFFFFFFFF
    header_words(client._mm)[REQUESTS_WORD] = client._sent
    deadline = time.monotonic() + 20
    while not client._poll.poll(100):
        assert time.monotonic() < deadline, "no response"
    client._received = (client._received + 1) & 0xFFFFFFFF
    return dsc.Response.parse(os.read(client._resp_fd, dsc.SIZE))


def test_refused_link_steps_keep_the_channel_a_malformed_one_ends_it(worker):
    assert segment.available(), "no writable /dev/shm: the shared-memory fast path cannot be tested"
    client = ShmClient("shm", 1 << 16, torch.device("cpu"), spin_us=0)
    server = ShmServer(
        Hello.decode(client.hello()), torch.device("cpu"), worker.forward, spin_us=0, link=worker
    )
    try:
        client.accept(server.start().result(10))
        # no link on a shm channel: refused with the reason, the channel serves on
        r = _post(client, _step(seq=11).pack())
        assert (r.seq, r.code) == (11, errors.FAILED_PRECONDITION) and "no device link" in r.message
        # with a link (set here: a CPU channel cannot map one): launched, then refused steps
        graphs = server._link = CpuLink()
        r = _post(client, _step(seq=12).pack())
        assert (r.seq, r.code) == (12, 0) and len(graphs.launched) == 1
        r = _post(client, _step(seq=13, step=2, generation=9).pack())
        assert r.code == errors.FAILED_PRECONDITION and "generation 9" in r.message
        worker.start_drain("draining for a test")
        r = _post(client, _step(seq=14, step=2).pack())
        assert r.code == errors.UNAVAILABLE and "draining" in r.message
        worker.draining = worker.refusing = ""
        r = _post(client, _step(seq=15, step=2, bucket=32, rows=1).pack())
        assert r.code == errors.INVALID_ARGUMENT and "bucket 32" in r.message
        # an ordinary request still works on this channel
        req = ExpertRequest(
            16, 0, 2, torch.randn(2, H), torch.tensor([[0, 1], [3, -1]], dtype=torch.int32), torch.rand(2, 2)
        )
        reply = client.send(req, torch.float32)
        assert reply is not None
        w = worker.slots.live.layers[2]
        torch.testing.assert_close(
            reply.result(10).double(),
            reference_moe(req.hidden, w.w13, w.w2, req.slot_ids, req.weights),
            rtol=1e-5,
            atol=1e-3,  # float32 sums of terms ~1e5 (FakeReader's weights)
        )
        reply.release()
        # a corrupted LinkStep is a malformed descriptor: INVALID_ARGUMENT, the channel ends
        raw = bytearray(_step(seq=17, step=3).pack())
        raw[20] ^= 1
        r = _post(client, bytes(raw))
        assert r.code == errors.INVALID_ARGUMENT and "checksum" in r.message
        server._thread.join(10)
        assert not server._thread.is_alive()
    finally:
        server.close()
        client.close()


# ---------------------------------------------------------------------- the step graph (GPU)

GR, GH, GI, GK, GS, GL = 8, 256, 128, 4, 8, 3  # rows R, hidden, intermediate, top-k, slots, MoE layers
GDT = torch.bfloat16


class _Coordinator:
    """A stand-in for the coordinator's linked graph, eager on a stream of its own: per layer
    publish the request, wait for the answer, keep it and its status."""

    def __init__(self, req: link.RequestViews, ans: link.AnswerViews) -> None:
        self.req, self.ans = req, ans
        self.step = link.StepWord(DEV)
        self.abort = torch.full((1,), -1, dtype=torch.int64, device=DEV)
        self.errors = torch.zeros(1, dtype=torch.int64, device=DEV)
        self.stream = torch.cuda.Stream(DEV)

    def warm(self, tb: int) -> None:
        """Every kernel of :meth:`run` once, with its waits returning at once (abort = the
        step): nothing new may load while the server's graph spins (link.py's NOTE)."""
        self.abort.fill_(0)
        xs, ids, ws = _inputs(tb, tb, seed=0)
        self.run(0, tb, xs, ids, ws, self.buffers(tb))
        self.errors.zero_()  # NOTE: the aborted waits reported their missing answers (ERR_TIMEOUT)

    @staticmethod
    def buffers(tb: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [torch.zeros(tb, GH, dtype=GDT, device=DEV) for _ in range(GL)], torch.zeros(
            GL, dtype=torch.int64, device=DEV
        )

    def run(self, step: int, tb: int, xs, ids, ws, bufs) -> tuple[list[torch.Tensor], list[int]]:
        outs, status = bufs
        self.step.set(step, tb)
        with torch.cuda.stream(self.stream):
            self.step.copy_in()
            for i in range(GL):
                self.req.x[:tb].copy_(xs[i])
                self.req.ids[:tb].copy_(ids[i])
                self.req.w[:tb].copy_(ws[i])
                link.signal(self.req.flag, self.step.step, i)
                link.wait(self.ans.flag, self.step.step, i, self.abort, self.errors, 5.0)
                outs[i].copy_(self.ans.out[:tb])
                status[i : i + 1].copy_(self.ans.status)
            self.step.replayed()
        torch.cuda.synchronize(DEV)
        return outs, status.tolist()


def _layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [
        (
            (torch.randn(GS, 2 * GI, GH, generator=g, device=DEV) * 0.1).to(GDT),
            (torch.randn(GS, GH, GI, generator=g, device=DEV) * 0.1).to(GDT),
        )
        for _ in range(GL)
    ]


def _inputs(tb: int, rows: int, seed: int, bad_layer: int | None = None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    xs = [torch.randn(tb, GH, generator=g, device=DEV).to(GDT) for _ in range(GL)]
    ids = [torch.randint(0, GS, (tb, GK), generator=g, device=DEV, dtype=torch.int32) for _ in range(GL)]
    ws = [torch.rand(tb, GK, generator=g, device=DEV) for _ in range(GL)]
    for i in ids:
        i[rows:] = -1  # padding rows
    if bad_layer is not None:
        ids[bad_layer][0, 1], ids[bad_layer][rows - 1, 0] = GS + 3, -5
    return xs, ids, ws


def _check(outs, layers, xs, ids, ws) -> None:
    for out, (w13, w2), x, i, w in zip(outs, layers, xs, ids, ws):
        clean = torch.where((i < -1) | (i >= GS), -1, i)
        ref = reference_moe(x.cpu().float(), w13.cpu().float(), w2.cpu().float(), clean.cpu(), w.cpu())
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.gpu
def test_step_graph_against_the_moe_with_a_fake_coordinator():
    """One process, one GPU: the server's step graph (captured on first use, replayed on one
    stream) and a coordinator on another hand over GL layers per step through link.signal /
    link.wait: answers = the MoE of each layer's request (float64 reference), bad ids computed
    as -1 with ERR_BAD_SLOT in the status, a silent coordinator costs the server one timeout
    and the link goes on; a new generation recaptures with the new weights."""
    from gpu_server.backend import TritonExpertBackend
    from gpu_server.graphs import BUCKETS

    area = link.new_area(link.request_bytes(GR, GH, GK, GDT), DEV)
    graphs = LinkGraphs(TritonExpertBackend.for_device(DEV), area, GR, GH, GK, GDT, BUCKETS)
    graphs.fold_every = 1  # every report carries its step's counts (lazy folding: at the end)
    req = link.RequestViews.of(area, GR, GH, GK, GDT)
    coord = _Coordinator(req, link.AnswerViews.of(graphs.answer, GR, GH, GDT))
    server = torch.cuda.Stream(DEV)
    layers = _layers(1)
    for tb in (4, 8):
        coord.warm(tb)

    def step(n: int, tb: int, rows: int, seed: int, bad: int | None = None, gen: int = 0, w=layers):
        xs, ids, ws = _inputs(tb, rows, seed, bad)
        bufs = coord.buffers(tb)  # NOTE: allocated (a fill kernel) before the server spins
        with torch.cuda.stream(server):
            report = graphs.launch(gen, w, tb, n, rows, 5000)
        outs, status = coord.run(n, tb, xs, ids, ws, bufs)
        assert int(coord.errors) == 0, "the coordinator's waits timed out"
        _check(outs, w, xs, ids, ws)
        return report, status, ids

    report, status, ids = step(1, 4, 3, seed=10)  # capture of bucket 4
    assert report is None and status == [0] * GL
    report, status, _ = step(2, 4, 4, seed=11, bad=1)  # a replay; bad ids in layer 1
    assert status == [0, link.ERR_BAD_SLOT, link.ERR_BAD_SLOT]  # the step's bits so far
    assert report is not None and (report.step, report.errors) == (1, 0)
    for i, c in zip(ids, report.counts):  # step 1's pairs per slot, counted on the GPU
        assert c.tolist() == np.bincount(i[i >= 0].cpu().numpy(), minlength=GS).tolist()
    report, status, _ = step(3, 8, 8, seed=12)  # another bucket: captured beside the first
    assert status == [0] * GL and report is not None and report.bad_slots and not report.timed_out
    assert len(graphs._graphs) == 2
    # a coordinator that never signals: the server's first wait times out, the rest runs through
    t0 = time.perf_counter()
    with torch.cuda.stream(server):
        graphs.launch(0, layers, 4, 4, 2, 300)
    server.synchronize()
    took = time.perf_counter() - t0
    assert 0.3 <= took < 0.3 * GL + 5.0, took  # one timeout (+ the capture of this timeout's graph)
    report, status, ids5 = step(5, 4, 2, seed=13)  # the link goes on
    assert status == [0] * GL and report is not None and report.step == 4 and report.timed_out

    def pairs(*steps):
        return [
            sum(np.bincount(s[layer][s[layer] >= 0].cpu().numpy(), minlength=GS) for s in steps)
            for layer in range(GL)
        ]

    # from here counts are folded lazily (FOLD_EVERY): none is lost, whenever the fold comes
    graphs.fold_every = 1000
    # a new placement generation: the old graphs dropped, new weights; the old generation's
    # last counts come with the launch that retires it
    new = _layers(2)
    report, status, ids6 = step(6, 4, 4, seed=14, gen=1, w=new)
    assert status == [0] * GL and graphs.generation == 1 and len(graphs._graphs) == 1
    assert (
        report is not None
        and report.step == 5
        and [c.tolist() for c in report.counts] == [c.tolist() for c in pairs(ids5)]
    )
    report, status, ids7 = step(7, 4, 3, seed=15, gen=1, w=new)
    assert status == [0] * GL and report is not None and report.step == 6 and report.counts == []
    report = graphs.close()  # the rest of the counts
    assert report is not None and (report.step, report.errors) == (7, 0) and not graphs._graphs
    assert [c.tolist() for c in report.counts] == [c.tolist() for c in pairs(ids6, ids7)]


@pytest.mark.gpu
def test_server_accepts_a_forced_link_on_one_gpu(monkeypatch, worker_gpu):
    """The Ack of a cuda_ipc hello with a link offer: link_area when accepted (EXPERTMESH_LINK
    force on one GPU), link_reason otherwise. The coordinator's area is mapped in-process here
    (an IPC handle cannot be opened by the process that made it): Mapped.open is replaced by a
    view of the same memory; the cross-process path is tests/test_link_e2e.py."""
    from expertmesh.transport import cuda_ipc

    area = link.new_area(link.request_bytes(GR, H, 2, torch.float32), DEV)
    monkeypatch.setattr(cuda_ipc.Mapped, "open", classmethod(lambda cls, info, dev: cls(area, 0)))
    offer = {"area": {"handle": "11" * 64, "offset": 0, "nbytes": area.numel()}, "rows": GR, "top_k": 2}
    hello = Hello("shm", f"expertmesh-1-2-{'ab' * 8}", 8192, 4096, 4096, "0" * 32)
    server = ShmServer(hello, DEV, worker_gpu.forward, link=worker_gpu, link_mode="force")
    ack = server._open_link(offer, same_gpu=True)
    assert set(ack) == {"link_area"} and ack["link_area"]["nbytes"] == link.answer_bytes(GR, H, torch.float32)
    assert server._link.buckets == (1, 2, 4, 8)
    server._drop_link()
    auto = ShmServer(hello, DEV, worker_gpu.forward, link=worker_gpu, link_mode="auto")
    assert "time-slice" in auto._open_link(offer, same_gpu=True)["link_reason"]


@pytest.fixture
def worker_gpu() -> ExpertWorker:
    from gpu_server.backend import TritonExpertBackend
    from gpu_server.graphs import GraphedBackend

    slots = SlotTable(FakeReader(), torch.float32, DEV, 4)  # type: ignore[arg-type]
    slots.preload([0, 1, 2, 3])
    backend = GraphedBackend(TritonExpertBackend.for_device(DEV))
    return ExpertWorker(slots, backend, WorkerIdentity("gpu", str(DEV), "host"))
