"""The one expert request type end to end, without processes: both codecs (gRPC message, shared
memory descriptor) carry every field of ExpertRequest, ``adapter_slots`` included, to the
gRPC-free worker core, which checks it (typed errors) and computes."""

from __future__ import annotations

import pytest
import torch

from expertmesh import errors, wire
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.transport import segment
from expertmesh.transport.client import ShmClient
from expertmesh.transport.handshake import Hello
from expertmesh.transport.server import ShmServer
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest
from tests.test_slots import FakeReader, H


@pytest.fixture
def worker() -> ExpertWorker:
    slots = SlotTable(FakeReader(), torch.float32, torch.device("cpu"), 4)  # type: ignore[arg-type]
    slots.preload([0, 1, 2, 3])
    return ExpertWorker(slots, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"))


def request(t: int = 3, adapters: torch.Tensor | None = None, **kw) -> ExpertRequest:
    g = torch.Generator().manual_seed(t)
    args = dict(
        seq=7,
        generation=0,
        layer=2,
        hidden=torch.randn(t, H, generator=g),
        slot_ids=torch.randint(-1, 4, (t, 2), generator=g, dtype=torch.int32),
        weights=torch.rand(t, 2, generator=g),
        adapter_slots=adapters,
    )
    return ExpertRequest(**{**args, **kw})  # type: ignore[arg-type]


def same(a: ExpertRequest, b: ExpertRequest) -> bool:
    def eq(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return (
        (a.seq, a.generation, a.layer) == (b.seq, b.generation, b.layer)
        and all(eq(getattr(a, f), getattr(b, f)) for f in ("slot_ids", "weights", "adapter_slots"))
        and torch.equal(a.gathered(), b.gathered())
    )


def test_worker_core_computes_and_counts(worker):
    req = request()
    out = worker.compute(worker.check(req))
    w = worker.slots.live.layers[2]
    assert torch.equal(out, torch_moe(req.hidden, w.w13, w.w2, req.slot_ids, req.weights))
    assert (worker.stats.requests, worker.stats.tokens) == (1, 3)
    ids = req.slot_ids.flatten()
    assert worker.tokens_per_slot[2].tolist() == torch.bincount(ids[ids >= 0], minlength=4).tolist()


@pytest.mark.parametrize(
    "kw, err, words",
    [
        (
            dict(adapters=torch.tensor([0, -1, -1], dtype=torch.int32)),
            errors.InvalidRequest,
            "adapter slots [0]",
        ),
        (dict(adapters=torch.tensor([-1, -1, -1])), errors.InvalidRequest, "int32 [3]"),
        (dict(adapters=torch.tensor([-1, -1], dtype=torch.int32)), errors.InvalidRequest, "int32 [3]"),
        (dict(generation=4), errors.StaleGeneration, "not the live generation 0"),
        (dict(layer=1), errors.InvalidRequest, "layer 1 is not an MoE layer"),
        (dict(weights=torch.full((3, 2), float("nan"))), errors.InvalidRequest, "NaN"),
    ],
)
def test_worker_core_refuses_with_typed_errors(worker, kw, err, words):
    with pytest.raises(err) as ei:
        worker.check(request(**kw))
    assert words in ei.value.message


def test_adapter_slots_are_checked_against_the_resident_adapters(worker):
    worker.check(request(adapters=torch.full((3,), -1, dtype=torch.int32)))  # no adapter: fine
    worker.adapter_slots = frozenset({2})
    worker.check(request(adapters=torch.tensor([2, -1, 2], dtype=torch.int32)))
    with pytest.raises(
        errors.InvalidRequest, match=r"\[1\] hold no adapter on this server \(loaded: \[2\]\)"
    ):
        worker.check(request(adapters=torch.tensor([2, 1, 2], dtype=torch.int32)))


@pytest.mark.parametrize("adapters", [None, torch.tensor([1, -1], dtype=torch.int32)])
def test_grpc_codec_carries_every_field(adapters):
    full = request(t=4)
    rows = torch.tensor([1, 3])
    req = ExpertRequest(5, 9, 2, full.hidden, full.slot_ids[rows], full.weights[rows], adapters, rows)
    back = wire.decode_request(wire.encode_request(req, torch.float32))
    assert back.rows is None and same(back, req)
    assert torch.equal(back.hidden, full.hidden[rows])


@pytest.mark.parametrize("adapters", [None, torch.tensor([3, -1, 3], dtype=torch.int32)])
def test_shm_codec_carries_every_field_to_the_core(worker, adapters):
    # NOTE: not skipped without /dev/shm: the project targets Linux hosts, where the fast path must work
    assert segment.available(), "no writable /dev/shm: the shared-memory fast path cannot be tested"
    worker.adapter_slots = frozenset({3})
    seen: list[ExpertRequest] = []

    def forward(r: ExpertRequest) -> torch.Tensor:
        seen.append(r)
        return worker.forward(r)

    client = ShmClient("shm", 1 << 16, torch.device("cpu"), spin_us=0)
    server = ShmServer(Hello.decode(client.hello()), torch.device("cpu"), forward, spin_us=0)
    try:
        client.accept(server.start().result(10))
        full = request(t=5)
        rows = torch.tensor([0, 2, 4])
        req = ExpertRequest(1, 0, 2, full.hidden, full.slot_ids[rows], full.weights[rows], adapters, rows)
        reply = client.send(req, torch.float32)
        assert reply is not None
        out = reply.result(10).clone()
        reply.release()
        assert len(seen) == 1 and same(seen[0], req)
        assert torch.equal(
            out, worker.compute(ExpertRequest(1, 0, 2, full.hidden[rows], req.slot_ids, req.weights))
        )
    finally:
        server.close()
        client.close()
