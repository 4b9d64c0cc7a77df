"""The host link (cpu_expert_server/hostlink.py, kernels/moe_hostlink.c) end to end on the CPU:
a real ShmClient offering it, a real ShmServer and CPU worker accepting it, and this test as
the coordinator's graph (per layer: write the request, bump its flag, spin on the answer flag).
Answers must equal the CPU backend's ``forward`` bit for bit and plain torch's MoE within the
quantisation's error; bad slot ids, a missing flag, a cancel, another generation, a commit in
flight and loaded LoRA adapters (no matter: a linked step is the base model's) each get their documented answer while the channel serves on."""

from __future__ import annotations

import itertools
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from coordinator.experts.expert_conn import ServerConnection
from cpu_expert_server import kernels
from cpu_expert_server.backend import CpuExpertBackend
from cpu_expert_server.packing import PER_ROW
from expertmesh import errors
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport import segment
from expertmesh.transport.client import ShmClient
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.layout import HEADER_BYTES
from expertmesh.transport.server import ShmServer
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.server import slot_table
from tests.test_cpu_backend import caps_of, rel, unpack_reference

H, I, E, K, R = 128, 64, 8, 2, 8  # noqa: E741  hidden, intermediate, experts, top-k, the areas' rows
DT = torch.bfloat16
CPU = torch.device("cpu")


class Reader:
    """A checkpoint of two MoE layers of E random experts (seeded by layer and expert)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            hidden_size=H, moe_intermediate_size=I, moe_layer_ids=[0, 1], num_experts=E, model_type="test"
        )

    def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
        g = torch.Generator().manual_seed(1000 * layer + e)
        return SimpleNamespace(
            w13=torch.randn(2 * I, H, generator=g) / H**0.5, w2=torch.randn(H, I, generator=g) / I**0.5
        )

    def expert_into(self, layer: int, e: int, gate, up, w2) -> None:
        w = self.expert_weights(layer, e)
        gate.copy_(w.w13[:I].reshape(gate.shape))
        up.copy_(w.w13[I:].reshape(up.shape))
        w2.copy_(w.w2)


def make_worker(wdtype: str, backend=None, dtype: torch.dtype = DT, group: int = 64) -> ExpertWorker:
    if backend is None:
        if kernels.load() is None:
            pytest.fail("the C kernels did not build on a machine with a C compiler")
        backend = CpuExpertBackend(threads=1, weight_dtype=wdtype, group=group)
    slots = slot_table(Reader(), backend, dtype, CPU, E)  # type: ignore[arg-type]
    slots.preload(list(range(E)))
    return ExpertWorker(slots, backend, WorkerIdentity("cpu", "cpu", "host"))


class Coordinator:
    """The coordinator's side in Python: the real ShmClient, its host link's areas written and
    polled as the linked graph would (payload first, then the flag)."""

    def __init__(self, worker: ExpertWorker, offer=(R, H, K, DT), mode: str = "auto") -> None:
        assert segment.available(), "no writable /dev/shm: the host link cannot be tested"
        self.client = ShmClient("shm", 1 << 16, CPU, spin_us=0, link=offer)
        self.server = ShmServer(
            Hello.decode(self.client.hello()),
            CPU,
            worker.forward,
            spin_us=0,
            forward_into=worker.forward_into,
            link=worker,
            link_mode=mode,
        )
        self.ack = self.server.start().result(10)
        self.client.accept(self.ack)
        self.seq = itertools.count(1)

    @property
    def lnk(self):
        lnk = self.client.link
        assert lnk is not None and lnk.host, self.client.link_reason
        return lnk

    def launch(self, step: int, rows: int, bucket: int, generation: int = 0, timeout_ms: int = 10_000):
        desc = dsc.LinkStep(next(self.seq), step, rows, bucket, generation, timeout_ms)
        return self.client.link_step(desc, time.monotonic() + 10)

    def publish(self, step: int, i: int, x, ids, w) -> int:
        lnk, tb = self.lnk, x.shape[0]
        lnk.req.x[:tb], lnk.req.ids[:tb], lnk.req.w[:tb] = x, ids, w
        want = step * ll.STEP_SPAN + i + 1
        lnk.req.flag[0] = want  # NOTE: after the payload (x86 keeps stores in order)
        return want

    def answer(self, want: int, tb: int, timeout_s: float = 10.0) -> tuple[torch.Tensor, int]:
        flag = self.lnk.ans.flag.numpy()
        deadline = time.monotonic() + timeout_s
        while flag[0] != want:
            assert time.monotonic() < deadline, f"no answer {want} (flag {flag[0]})"
        return self.lnk.ans.out[:tb].clone(), int(self.lnk.ans.status[0])

    def layer(self, step: int, i: int, x, ids, w) -> tuple[torch.Tensor, int]:
        return self.answer(self.publish(step, i, x, ids, w), x.shape[0])

    def status_bits(self, bits: int, timeout_s: float) -> float:
        """Seconds until the answer's status shows ``bits``."""
        t0 = time.monotonic()
        while not int(self.lnk.ans.status[0]) & bits:
            assert time.monotonic() - t0 < timeout_s, "the status never changed"
            time.sleep(0.001)
        return time.monotonic() - t0

    def close(self) -> None:
        self.server.close()
        self.server._thread.join(10)
        self.client.close()


def inputs(tb: int, rows: int, seed: int, dtype: torch.dtype = DT):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tb, H, generator=g).to(dtype)  # [Tb, H]
    ids = torch.randint(-1, E, (tb, K), generator=g, dtype=torch.int32)  # [Tb, K]
    w = torch.rand(tb, K, generator=g)  # [Tb, K]
    ids[rows:] = -1  # padding rows
    return x, ids, w


def plain_moe(worker: ExpertWorker, layer: int, x, ids, w) -> torch.Tensor:
    """float64 torch MoE over the weights the server holds (dequantised, de-interleaved)."""
    be = worker.backend
    assert isinstance(be, CpuExpertBackend) and be.fmt is not None
    ls = worker.slots.live.layers[layer]
    if be.fmt.quantised:
        w13, w2 = unpack_reference(be.fmt, ls.w13, ls.w2)
    else:
        rb, s = be.fmt.rb, ls.w13.shape[0]
        w13 = ls.w13.view(s, I // rb, 2, rb, H).transpose(1, 2).reshape(s, 2 * I, H)
        w2 = ls.w2
    return torch_moe(x.double(), w13.double(), w2.double(), ids.long(), w.double())


# ---------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "wdtype, dtype, group",
    [
        ("bfloat16", DT, 64),
        ("int4", DT, 64),
        ("int4", DT, PER_ROW),  # --weight-group row: the linked step's blocks with one scale a row
        ("bfloat16", torch.float32, 64),
        ("int4", torch.float32, 64),
    ],
)
def test_answers_equal_the_backend_and_torch(wdtype, dtype, group):
    worker = make_worker(wdtype, dtype=dtype, group=group)
    c = Coordinator(worker, (R, H, K, dtype))
    try:
        ans = c.lnk.answer  # whole pages of the segment, as the request area: the GPU maps both
        assert ans is not None and ans.data_ptr() % 4096 == 0 and ans.numel() % 4096 == 0
        assert ans.data_ptr() == c.lnk.ans.flag.data_ptr() > c.lnk.area.data_ptr()
        step = 0
        for bucket, rows in ((1, 1), (4, 2)):  # T=1, and a bucket of 4 with 2 padding rows
            step += 1
            assert c.launch(step, rows, bucket).code == 0
            for i, layer in enumerate(worker.slots.moe_layers):
                x, ids, w = inputs(bucket, rows, seed=10 * step + i, dtype=dtype)
                out, status = c.layer(step, i, x, ids, w)
                ls = worker.slots.live.layers[layer]
                assert status == 0
                assert torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
                ref = plain_moe(worker, layer, x, ids, w)
                tol = 2e-2 if wdtype == "int4" or dtype == DT else 1e-5  # activations quantised / rounded
                if group == PER_ROW:  # activations quantised over the whole row, not groups of 64
                    tol = 3e-2
                assert rel(out[:rows], ref[:rows]) < tol, rel(out[:rows], ref[:rows])
                assert not out[rows:].any(), "padding rows must come out as zeros"
        # the next launch collects the last step's report: every routed pair counted
        assert c.launch(step + 1, 1, 1).code == 0
        assert worker.stats.errors == 0 and worker.stats.requests == 3 * len(worker.slots.moe_layers)
        # the kernel thread's own split of the two answered steps, in the worker's /metrics
        st = worker.stats
        assert st.link_steps == 2 and st.link_layers == 2 * len(worker.slots.moe_layers)
        assert st.link_kernel_seconds > 0 and st.link_wait_seconds >= 0
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        got = {
            s.name: s.value
            for f in text_string_to_metric_families(generate_latest(worker.metrics.registry).decode())
            for s in f.samples
        }
        assert got["expertmesh_worker_link_layers_total"] == st.link_layers
        assert got["expertmesh_worker_link_kernel_seconds_total"] == pytest.approx(st.link_kernel_seconds)
    finally:
        c.close()


@pytest.mark.parametrize("wdtype, bucket", [("bfloat16", 1), ("int4", 32)])
def test_amx_plans_answer_as_forward_emulated(wdtype, bucket):
    """The plans' moe_amx_a blocks (bf16 at any size; int4 past decode sizes: 64 pairs over 8
    slots) on every x86-64 machine, the tile instructions emulated in C; the device host runs
    the real ones (benchmarks/bench_hostlink.py)."""
    lib = kernels.load(("EXPERTMESH_AMX_EMULATE",))
    if lib is None:
        pytest.fail("the C kernels did not build on a machine with a C compiler")
    be = CpuExpertBackend(threads=1, weight_dtype=wdtype, group=64, caps=caps_of("avx2"))
    be.lib, be.caps, be.amx = lib, be.caps | kernels.CAPS["amx"][0], True
    worker = make_worker(wdtype, be)
    c = Coordinator(worker, (bucket, H, K, DT))
    try:
        assert c.launch(1, bucket, bucket).code == 0
        for i, layer in enumerate(worker.slots.moe_layers):
            x, ids, w = inputs(bucket, bucket, seed=20 + i)
            ls = worker.slots.live.layers[layer]
            assert be.kernel_for(DT, bucket, K, ls.w13)[0] == "amx"
            out, status = c.layer(1, i, x, ids, w)
            assert status == 0 and torch.equal(out, be.forward(x, ls.w13, ls.w2, ids, w))
    finally:
        c.close()


def test_bad_slot_ids_answer_zeros_and_the_link_serves_on():
    worker = make_worker("int4")
    c = Coordinator(worker)
    try:
        assert c.launch(1, 2, 2).code == 0
        x, ids, w = inputs(2, 2, seed=1)
        bad = ids.clone()
        bad[0, 1] = E + 3
        out, status = c.layer(1, 0, x, bad, w)
        assert status == ll.ERR_BAD_SLOT and not out.any()
        out, status = c.layer(1, 1, x, ids, w)  # the step goes on (its status keeps the bit)
        ls = worker.slots.live.layers[1]
        assert status == ll.ERR_BAD_SLOT and torch.equal(
            out, worker.backend.forward(x, ls.w13, ls.w2, ids, w)
        )
        assert c.launch(2, 2, 2).code == 0  # collects the report: a bad-slot error counted
        assert worker.stats.errors == 1
        out, status = c.layer(2, 0, x, ids, w)
        assert status == 0 and out.any()
    finally:
        c.close()


# ---------------------------------------------------------------------- timeouts, cancels, close


def test_a_missing_flag_times_out_and_the_next_step_runs():
    worker = make_worker("int4")
    c = Coordinator(worker)
    try:
        t0 = time.monotonic()
        assert c.launch(1, 1, 1, timeout_ms=200).code == 0
        c.status_bits(ll.ERR_TIMEOUT, 10)
        assert time.monotonic() - t0 >= 0.2
        assert int(c.lnk.ans.flag[0]) == 0, "a layer that never came is never answered"
        assert c.launch(2, 1, 1).code == 0
        assert worker.stats.errors == 1  # the timed-out step, reported at this launch
        x, ids, w = inputs(1, 1, seed=3)
        out, status = c.layer(2, 0, x, ids, w)
        assert status == 0 and out.any()
    finally:
        c.close()


def test_cancel_ends_a_step_in_flight_at_once():
    worker = make_worker("int4")
    c = Coordinator(worker)
    try:
        assert c.launch(1, 1, 1, timeout_ms=60_000).code == 0
        x, ids, w = inputs(1, 1, seed=4)
        assert c.layer(1, 0, x, ids, w)[1] == 0
        link = c.server._link
        worker.cancel_link(link)  # what the channel's close does when its coordinator is gone
        assert c.status_bits(ll.ERR_TIMEOUT, 5) < 5
        assert link.collect().timed_out
        assert c.launch(2, 1, 1).code == 0  # the thread took the next step
        assert c.layer(2, 0, x, ids, w)[1] == 0
    finally:
        c.close()


def _new_tasks(before: set[str]) -> set[str]:
    """This process's threads that were not there ``before`` (a joined thread may linger in
    /proc for a moment: up to 2 s for them to go). Compared by id, not by count: a thread an
    earlier test left behind may end meanwhile and hide one that leaked."""
    deadline = time.monotonic() + 2
    while True:
        new = set(os.listdir("/proc/self/task")) - before
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.01)


def test_closing_the_channel_mid_step_joins_the_thread():
    worker = make_worker("int4")
    be = worker.backend
    kt = kernels.kernel_thread(be, be.lib, be.threads)  # the backend's: it outlives every link
    assert kt is not None
    before = set(os.listdir("/proc/self/task"))
    c = Coordinator(worker)
    assert c.launch(1, 1, 1, timeout_ms=60_000).code == 0
    link = c.server._link
    assert link._kt is kt
    t0 = time.monotonic()
    c.close()  # the coordinator's stream ended: the step waiting for layer 0 ends, the link goes
    assert time.monotonic() - t0 < 5 and not c.server._thread.is_alive()
    assert c.server._link is None and link._h is None
    assert not _new_tasks(before), "a thread of the channel outlived it"


def test_two_links_and_python_calls_share_one_kernel_thread():
    """Two coordinators' links on one server run on the backend's one kernel thread: their steps
    interleave layer by layer, and a call from Python (the gRPC path's) runs between two layers
    while both steps wait for their next one; every answer equals ``forward``'s."""
    worker = make_worker("int4")
    a, b = Coordinator(worker), Coordinator(worker)
    try:
        assert a.server._link._kt is b.server._link._kt is worker.backend._kt
        assert a.launch(1, 2, 2).code == 0 and b.launch(1, 1, 1).code == 0
        layers = worker.slots.moe_layers
        order = [(a, 0, 2), (b, 0, 1), (None, 0, 3), (b, 1, 1), (a, 1, 2)]  # (link or Python, layer, rows)
        for n, (c, i, rows) in enumerate(order):
            x, ids, w = inputs(rows, rows, seed=70 + n)
            ls = worker.slots.live.layers[layers[i]]
            if c is None:
                got: list[torch.Tensor] = []
                args = (x, ls.w13, ls.w2, ids, w)
                t = threading.Thread(target=lambda a=args, g=got: g.append(worker.backend.forward(*a)))
                t.start()
                t.join(10)
                assert got, "a Python call waited for the links' steps to end"
                out = got[0]
            else:
                out, status = c.layer(1, i, x, ids, w)
                assert status == 0
            assert torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
        assert a.launch(2, 1, 1).code == 0 and b.launch(2, 1, 1).code == 0  # both steps ended
        assert worker.stats.errors == 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------- refusals


def test_a_wrong_generation_is_refused_the_channel_lives_and_adapters_do_not_matter():
    worker = make_worker("int4")
    c = Coordinator(worker)
    try:
        r = c.launch(1, 1, 1, generation=5)
        assert r.code == errors.StaleGeneration("").status and "generation 5" in r.message
        # an adapter loaded: linked steps are base-model steps (adapter steps run eagerly on the
        # coordinator), so the step is taken and answers the base model's MoE
        worker.adapter_slots = frozenset({0})
        assert c.launch(1, 1, 1).code == 0
        x, ids, w = inputs(1, 1, seed=5)
        assert c.layer(1, 0, x, ids, w)[1] == 0
    finally:
        c.close()


def test_a_commit_waits_for_the_step_in_flight():
    worker = make_worker("int4")
    c = Coordinator(worker)
    try:
        assert c.launch(1, 1, 1).code == 0
        x, ids, w = inputs(1, 1, seed=6)
        c.layer(1, 0, x, ids, w)
        table = {layer: list(reversed(range(E))) for layer in worker.slots.moe_layers}
        worker.prepare(1, table)
        commit = threading.Thread(target=worker.commit, args=(1,))
        commit.start()
        commit.join(0.3)
        assert commit.is_alive(), "the commit rewrote the weights under a running step"
        c.layer(1, 1, x, ids, w)
        commit.join(10)
        assert not commit.is_alive() and worker.generation == 1
        r = c.launch(2, 1, 1, generation=0)
        assert r.code != 0 and "generation 0" in r.message
        assert c.launch(2, 1, 1, generation=1).code == 0  # new plans over the new weights
        out, status = c.layer(2, 0, x, ids, w)
        ls = worker.slots.live.layers[0]
        assert status == 0 and torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
    finally:
        c.close()


@pytest.mark.parametrize(
    "why, words",
    [
        ("off", "EXPERTMESH_LINK=0"),
        ("dtype", "computes hidden 128 in bfloat16"),
        ("torch", "serves no host link"),
    ],
)
def test_the_ack_says_why_there_is_no_host_link(why, words):
    worker = make_worker("int4", TorchExpertBackend() if why == "torch" else None)
    offer = (R, H, K, torch.float32 if why == "dtype" else DT)
    c = Coordinator(worker, offer, mode="off" if why == "off" else "auto")
    try:
        assert c.ack.transport == "shm" and words in c.ack.host_link["reason"]
        assert c.client.link is None and words in c.client.link_reason
        r = c.launch(1, 1, 1)  # refused with the reason; the channel serves on
        assert r.code != 0 and words in r.message
    finally:
        c.close()


# ---------------------------------------------------------------------- handshake and offer


def _hello(**offer) -> Hello:
    host = {"offset": HEADER_BYTES + 8192, "rows": R, "hidden": H, "top_k": K, "dtype": "bfloat16", **offer}
    _, _, end = ll.host_areas(HEADER_BYTES + 8192, R, H, K, DT)
    return Hello("shm", f"expertmesh-1-2-{'ab' * 8}", end, HEADER_BYTES, 8192, "0" * 32, None, host)


def test_hello_and_ack_carry_the_host_link():
    h = _hello()
    assert Hello.decode(h.encode()) == h
    plain = Hello("shm", h.segment, h.size, h.ring_offset, h.ring_bytes, h.token)
    assert b"host_link" not in plain.encode() and Hello.decode(plain.encode()).host_link is None
    ack = Ack("shm", host_link={"accepted": True})
    assert Ack.decode(ack.encode()) == ack and b"host_link" not in Ack("shm").encode()
    req, ans, end = ll.host_areas(HEADER_BYTES + 100, R, H, K, DT)
    assert req % 4096 == 0 and ans % 4096 == 0 and ans >= req + ll.request_bytes(R, H, K, DT)
    assert end % 4096 == 0 and end >= ans + ll.answer_bytes(R, H, DT)


@pytest.mark.parametrize(
    "offer, words",
    [
        (dict(offset=HEADER_BYTES), "not after the ring"),
        (dict(rows=4 * R), "inside the"),
        (dict(dtype="int32"), "host link offer"),
        (dict(top_k=0), "host link offer"),
        (dict(rows=True), "host link offer"),
        (dict(extra=1), "host link offer"),
    ],
)
def test_bad_host_link_offers_are_rejected(offer, words):
    with pytest.raises(HandshakeError, match=words):
        Hello.decode(_hello(**offer).encode())


@pytest.mark.parametrize("transport, words", [("cuda_ipc", "shm only"), ("tcp", "no host link")])
def test_a_host_link_comes_with_shm_only(transport, words):
    raw = _hello().encode().replace(b'"transport": "shm"', f'"transport": "{transport}"'.encode())
    with pytest.raises(HandshakeError, match=words):
        Hello.decode(raw)
    with pytest.raises(HandshakeError, match="host_link must be an object"):
        Ack.decode(Ack("shm", host_link=[1]).encode())  # type: ignore[arg-type]


@pytest.mark.parametrize("kind, offered", [("cpu", True), ("gpu", False)])
def test_a_cuda_coordinator_offers_the_host_link_to_a_cpu_server_over_shm(kind, offered):
    spec = ServerSpec("c", "127.0.0.1:1", kind)
    conn = ServerConnection(spec, ClusterConfig((spec,)))
    try:
        conn.plan, conn.dtype, conn.link_shape = "shm", DT, (64, H, K)
        conn.info = SimpleNamespace(kind=kind)  # type: ignore[assignment]
        offer = conn._link_offer("host")
        assert (offer == (64, H, K, DT)) if offered else (offer is None and "not cuda_ipc" in conn.link_note)
        conn.link_shape = None  # a CPU coordinator never offers
        assert conn._link_offer("host") is None
    finally:
        conn.close()


def test_the_segment_holds_the_areas_after_the_ring():
    client = ShmClient("shm", 1 << 16, CPU, spin_us=0, link=(R, H, K, DT))
    try:
        h = Hello.decode(client.hello())
        assert h.host_link is not None and h.host_link["offset"] >= HEADER_BYTES + (1 << 16)
        area = client._link.area  # type: ignore[union-attr]
        assert area.numel() >= ll.request_bytes(R, H, K, DT) and not np.any(area.numpy())
        assert area.data_ptr() % 4096 == 0 and area.numel() % 4096 == 0  # whole pages: pinnable
        assert client.link is None and client.link_reason == "not offered"  # until the server takes it
    finally:
        client.close()
