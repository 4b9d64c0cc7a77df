"""The relayed link over the TCP data path (expertmesh/transport/tcp_relay.py) on the CPU: a real
TcpClient offering it, a real TcpServer and CPU worker (its host-link C thread) taking it, and
this test as the coordinator's graph (per layer: write the request area, bump its flag, spin on
the answer flag). Answers must equal the CPU backend's ``forward`` bit for bit; a malformed
relay frame or LinkStep drops that connection, counted, while the server serves on; TLS refuses
the relay. Then a real ``cpu-server`` process through the whole negotiation: answers against
plain torch, and SIGKILL mid-step gives the step an error status at once."""

from __future__ import annotations

import itertools
import signal
import socket
import ssl
import struct
import time
from pathlib import Path

import pytest
import torch

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport import tcp, tcp_relay
from expertmesh.transport.errors import Rejected
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.tcp_client import TcpClient
from expertmesh.transport.tcp_server import DataListener, TcpServer
from expertmesh.worker.core import ExpertWorker
from expertmesh.worker_api import ExpertRequest
from tests.test_hostlink import CPU, DT, H, K, R, inputs, make_worker
from tests.tls_utils import CA

LAYERS = 2  # tests/test_hostlink.py's checkpoint
TIMEOUT_S = 5.0  # the cluster timeout the test's coordinator runs with


class Coordinator:
    """The coordinator's side: the real TcpClient and its relayed link's areas, written and
    polled as the linked graph would (payload first, then the flag)."""

    def __init__(self, client: TcpClient) -> None:
        self.client = client
        self.seq = itertools.count(1)
        self._lnk = None

    @property
    def lnk(self):
        """The link once live (kept: a step's graph writes on after the relay died)."""
        if self._lnk is None:
            self._lnk = self.client.link
            assert self._lnk is not None and self._lnk.host, self.client.link_reason
        return self._lnk

    def launch(self, step: int, rows: int, bucket: int, generation: int = 0) -> dsc.Response:
        desc = dsc.LinkStep(next(self.seq), step, rows, bucket, generation, 600_000)
        return self.client.link_step(desc, time.monotonic() + 10)

    def layer(self, step: int, i: int, x, ids, w, timeout_s: float = 10.0) -> tuple[torch.Tensor, int]:
        lnk, tb = self.lnk, x.shape[0]
        lnk.req.x[:tb], lnk.req.ids[:tb], lnk.req.w[:tb] = x, ids, w
        want = step * ll.STEP_SPAN + i + 1
        lnk.req.flag[0] = want  # NOTE: after the payload (x86 keeps stores in order)
        flag, deadline = lnk.ans.flag.numpy(), time.monotonic() + timeout_s
        while flag[0] != want:
            assert time.monotonic() < deadline, f"no answer {want} (flag {flag[0]})"
            time.sleep(0)
        return lnk.ans.out[:tb].clone(), int(lnk.ans.status[0])


def client(**kw) -> TcpClient:
    return TcpClient(1 << 16, CPU, stall_s=TIMEOUT_S, link=(R, H, K, DT), link_layers=LAYERS, **kw)


def in_process(worker: ExpertWorker, tls: ssl.SSLContext | None = None, tally=None):
    listener = DataListener("127.0.0.1", 0, tls, on_drop=worker.metrics.dropped)
    c = client(relay_tally=tally)
    server = TcpServer(
        Hello.decode(c.hello()), listener, CPU, worker.forward, worker.data_path_error,
        forward_into=worker.forward_into, link=worker, relay_tally=worker.metrics.relays,
    )  # fmt: skip
    return listener, c, server, server.start().result(30)


def close_all(listener: DataListener, c: TcpClient, server: TcpServer) -> None:
    c.close()
    server.close()
    server._thread.join(10)
    listener.close()


def metric(worker: ExpertWorker, name: str, **labels: str) -> float:
    value = worker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# ---------------------------------------------------------------------- the handshake


def test_the_offer_round_trips_and_bad_offers_are_refused():
    c = client()
    try:
        hello = Hello.decode(c.hello())
        offer = hello.relay
        assert offer is not None and offer["layers"] == LAYERS and offer["dtype"] == "bfloat16"
        # the server relay's wait nests inside the coordinator's (tcp_relay's module text)
        assert offer["timeout_ms"] == int(TIMEOUT_S * tcp_relay.SERVER_RELAY * 1e3)
        assert tcp_relay.compute_timeout_ms(TIMEOUT_S) < offer["timeout_ms"] < TIMEOUT_S * 1e3
        for bad in (
            {**offer, "layers": 0},
            {**offer, "layers": 1024},
            {**offer, "token": hello.token},  # the stream's own token
            {**offer, "token": "zz" * 16},
            {**offer, "dtype": "int8"},
            {**offer, "rows": True},
            {k: v for k, v in offer.items() if k != "timeout_ms"},
        ):
            raw = Hello("tcp", "", 0, 0, hello.ring_bytes, hello.token, relay=bad).encode()
            with pytest.raises(HandshakeError, match="relay offer"):
                Hello.decode(raw)
        with pytest.raises(HandshakeError, match="unknown transport|relay must be"):
            Ack.decode(Ack("shm", relay={"accepted": True}).encode())
    finally:
        c.close()


def test_tls_refuses_the_relay_on_either_side(tmp_path: Path):
    tls = CA.make(tmp_path, "relay").issue(tmp_path, "localhost")
    c = TcpClient(1 << 16, CPU, stall_s=TIMEOUT_S, link=(R, H, K, DT), link_layers=LAYERS, tls=tls)
    try:
        assert c.link_reason == tcp_relay.TLS_REASON and Hello.decode(c.hello()).relay is None
    finally:
        c.close()
    worker = make_worker("int4")
    listener, c, server, ack = in_process(worker, tls=tcp.server_context(tls))
    try:
        assert ack.transport == "tcp" and ack.relay == {"reason": f"no relayed link: {tcp_relay.TLS_REASON}"}
    finally:
        c.close()
        server.close()
        listener.close()


# ---------------------------------------------------------------------- answers


def test_answers_equal_the_backend_through_the_relay():
    worker = make_worker("int4")
    tally = tcp_relay.RelayTally()  # the coordinator's counters (its metrics)
    listener, c, server, ack = in_process(worker, tally=tally)
    co = Coordinator(c)
    try:
        assert ack.relay == {"accepted": True, "micro_batches": 8}, ack
        c.accept(ack)
        assert c.link is not None and c.link_reason == ""
        step = 0
        for bucket, rows in ((1, 1), (4, 2), (R, R)):
            step += 1
            assert co.launch(step, rows, bucket).code == 0
            for i, layer in enumerate(worker.slots.moe_layers):
                x, ids, w = inputs(bucket, rows, seed=10 * step + i)
                out, status = co.layer(step, i, x, ids, w)
                ls = worker.slots.live.layers[layer]
                assert status == 0
                assert torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
                assert not out[rows:].any(), "padding rows must come out as zeros"
        # a step of another generation is refused; the connection and the link go on
        resp = co.launch(step + 1, 1, 1, generation=7)
        assert resp.code == errors.StaleGeneration("").status and c.link is not None
        assert co.launch(step + 2, 1, 1).code == 0
        for i, layer in enumerate(worker.slots.moe_layers):
            x, ids, w = inputs(1, 1, seed=99 + i)
            out, status = co.layer(step + 2, i, x, ids, w)
            ls = worker.slots.live.layers[layer]
            assert status == 0 and torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
        assert c._relay is not None and c._relay.relay.wait_idle(5)
        assert c._relay.relay.stats().layers == 4 * LAYERS
        assert metric(worker, "expertmesh_worker_relay_events_total", kind="layers") == 4 * LAYERS
        assert metric(worker, "expertmesh_worker_relay_events_total", kind="connects") == 1
    finally:
        close_all(listener, c, server)
    # both sides' counters outlive the channel (Prometheus counters never go back)
    assert metric(worker, "expertmesh_worker_relay_events_total", kind="layers") == 4 * LAYERS
    seen = tally.totals()
    assert seen["steps"] == 4 and seen["layers"] == 4 * LAYERS and seen["connects"] == 1, seen


def test_a_micro_batched_step_through_the_relay_answers_each_micro_batch():
    """Two micro-batches of 2 rows in a bucket of 4: the graph's order (both micro-batches'
    requests of a layer out before the first answer is read), each answer equal to the
    backend's for that micro-batch's rows; then a plain step on the same link."""
    worker = make_worker("int4")
    listener, c, server, ack = in_process(worker)
    co = Coordinator(c)
    try:
        c.accept(ack)
        assert c.link is not None and c.link.micro == 8
        micro, rows, layers = 2, 2, worker.slots.moe_layers
        desc = dsc.LinkStep(next(co.seq), 1, 2 * rows - 1, micro * rows, 0, 600_000, micro=micro)
        assert c.link_step(desc, time.monotonic() + 10).code == 0
        lnk = co.lnk
        flag, ans_flag = lnk.req.flag.numpy(), lnk.ans.flag.numpy()
        sent: list[tuple] = []

        def answer(k: int) -> None:
            want, deadline = ll.STEP_SPAN + k + 1, time.monotonic() + 10
            while ans_flag[0] < want:
                assert time.monotonic() < deadline, f"no answer {k} (flag {ans_flag[0]})"
                time.sleep(0)
            layer, at, x, ids, w = sent[k]
            ls = worker.slots.live.layers[layer]
            got = lnk.ans.out[at : at + rows]
            assert int(lnk.ans.status[0]) == 0
            assert torch.equal(got, worker.backend.forward(x, ls.w13, ls.w2, ids, w)), (k, layer)

        for k in range(len(layers) * micro):
            if k >= micro:
                answer(k - micro)  # this micro-batch's answer to the layer before
            at = (k % micro) * rows
            x, ids, w = inputs(rows, rows if k % micro == 0 else rows - 1, seed=k)  # the last row pads
            lnk.req.x[at : at + rows], lnk.req.ids[at : at + rows], lnk.req.w[at : at + rows] = x, ids, w
            sent.append((layers[k // micro], at, x, ids, w))
            flag[0] = ll.STEP_SPAN + k + 1
        for k in range(len(layers) * micro - micro, len(layers) * micro):
            answer(k)
        assert c._relay is not None and c._relay.relay.wait_idle(5)
        assert c._relay.relay.stats().last_bits == 0
        assert c._relay.relay.stats().layers == len(layers) * micro
        # a plain step after it
        assert co.launch(2, 1, 1).code == 0
        for i, layer in enumerate(layers):
            x, ids, w = inputs(1, 1, seed=50 + i)
            out, status = co.layer(2, i, x, ids, w)
            ls = worker.slots.live.layers[layer]
            assert status == 0 and torch.equal(out, worker.backend.forward(x, ls.w13, ls.w2, ids, w))
    finally:
        close_all(listener, c, server)


def test_a_link_that_is_not_relayed_refuses_micro_batched_steps():
    """Over shared memory the coordinator's area holds a micro-batch in rows the server's
    compute does not read: the step is refused (the coordinator runs it without the link)."""
    from cpu_expert_server.hostlink import HostLink

    worker = make_worker("int4")
    span, req, ans = tcp_relay.rl.host_areas(R, H, K, DT)
    link = worker.open_link(req, R, K, answer=ans, hidden=H, dtype=DT)
    try:
        assert isinstance(link, HostLink) and not link.relayed
        with pytest.raises(errors.InvalidRequest, match="relayed link only"):
            worker.link_step(link, dsc.LinkStep(1, 1, 2, 4, worker.slots.live.generation, 1000, micro=2))
        worker.link_step(link, dsc.LinkStep(2, 1, 2, 4, worker.slots.live.generation, 1000))  # plain: taken
    finally:
        worker.cancel_link(link)
        worker.close_link(link)


@pytest.mark.parametrize(
    "backend, why",
    [(None, "serves no link"), ("torch", "serves no host link"), ("int4-h", "offers hidden")],
    ids=["no-link-host", "torch-backend", "other-hidden"],
)
def test_a_server_that_cannot_link_refuses_and_the_tcp_path_serves_on(backend, why):
    worker = make_worker("int4", TorchExpertBackend() if backend == "torch" else None)
    listener = DataListener("127.0.0.1", 0, None)
    c = TcpClient(1 << 16, CPU, stall_s=TIMEOUT_S, link=(R, H * (2 if backend == "int4-h" else 1), K, DT),
                  link_layers=LAYERS)  # fmt: skip
    server = TcpServer(
        Hello.decode(c.hello()), listener, CPU, worker.forward, worker.data_path_error,
        link=worker if backend else None,
    )  # fmt: skip
    try:
        ack = server.start().result(30)
        assert ack.transport == "tcp" and why in ack.relay["reason"], ack
        c.accept(ack)
        assert c.link is None and why in c.link_reason
        with pytest.raises(Rejected, match="no relayed link"):
            c.link_step(dsc.LinkStep(1, 1, 1, 1, 0, 1000), time.monotonic() + 5)
        # the data path itself serves
        x, ids, w = inputs(2, 2, seed=4)
        layer = worker.slots.moe_layers[0]
        req = ExpertRequest(1, 0, layer, x, ids, w)
        reply = c.send(req, DT)
        assert reply is not None
        ls = worker.slots.live.layers[layer]
        assert torch.equal(reply.result(10), worker.backend.forward(x, ls.w13, ls.w2, ids, w))
    finally:
        close_all(listener, c, server)


# ---------------------------------------------------------------------- failures


def test_a_malformed_relay_frame_drops_that_connection_counted():
    """The relay's connection, reached by hand with the offer's token: a garbage frame drops
    it (counted in the metrics); the data connection serves on, refusing link steps until a
    relay connection comes back."""
    worker = make_worker("int4")
    listener, c, server, ack = in_process(worker)
    assert c._relay is not None
    token = c._relay.token
    c._relay.relay.close()  # this test plays the coordinator's relay end by hand
    c._relay = None
    raw = None
    try:
        assert ack.relay["accepted"] is True
        c.accept(ack)  # the data connection only
        raw = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        raw.sendall(tcp.PREAMBLE.pack(tcp.PREAMBLE_MAGIC, token))
        assert raw.recv(len(tcp.ACCEPTED)) == tcp.ACCEPTED
        relay = server.relay
        assert relay is not None and relay.relay is not None
        deadline = time.monotonic() + 5
        while not relay.relay.connected:
            assert time.monotonic() < deadline, "the relay never got its connection"
            time.sleep(0.01)
        raw.sendall(struct.pack("<IIq", 0xDEADBEEF, 1, 1) + bytes(64))
        assert raw.recv(1) == b"", "the relay must close a connection that sent garbage"
        assert metric(worker, "expertmesh_worker_relay_events_total", kind="malformed") == 1
        assert metric(worker, "expertmesh_worker_relay_events_total", kind="dropped") == 1
        # a LinkStep now: refused (no relay connection), the data connection lives on
        desc = dsc.LinkStep(1, 1, 1, 1, 0, 1000)
        c._relay = None
        sock = c._sock
        assert sock is not None
        sock.sendall(desc.pack())
        hdr = tcp.recv_into(sock, memoryview(buf := bytearray(dsc.SIZE)))
        resp = dsc.Response.parse(buf)
        assert hdr == dsc.SIZE and resp.code == errors.Unavailable("").status
        assert "no connection" in resp.message
        # a LinkStep that does not parse: that data connection is dropped and counted
        bad = bytearray(desc.pack())
        bad[40] ^= 0xFF
        sock.sendall(bad)
        tcp.recv_into(sock, memoryview(buf))
        assert dsc.Response.parse(buf).code == errors.InvalidRequest("").status
        deadline = time.monotonic() + 5
        while metric(worker, "expertmesh_worker_data_connections_dropped_total", reason="malformed") < 1:
            assert time.monotonic() < deadline, "the malformed LinkStep was not counted"
            time.sleep(0.01)
    finally:
        if raw is not None:
            raw.close()
        close_all(listener, c, server)


# ---------------------------------------------------------------------- a real server process


@pytest.mark.slow
def test_a_cpu_server_process_answers_through_the_negotiated_relay(tmp_path):
    """The whole negotiation with a real ``cpu-server`` process: a dispatcher whose connection
    offers the link (as a CUDA coordinator's does) over ``--transport tcp``, the LinkStep
    through ServerConnection, each layer's answer against plain torch over the checkpoint's
    weights; then SIGKILL of the server mid-step: that layer's status has ERR_WIRE at once and
    the failed step names the relay."""
    from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
    from coordinator.experts.remote import RemoteDispatcher
    from expertmesh.checkpoint import CheckpointReader
    from expertmesh.experts import torch_moe
    from tests.cluster_utils import start_server
    from tests.hf_models import make_checkpoint
    from tests.test_cpu_backend import rel

    make_checkpoint("qwen3_moe", tmp_path)
    reader = CheckpointReader(tmp_path)
    cfg = reader.config
    srv = start_server("cpu", tmp_path)
    cluster = ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), transport="tcp", timeout_s=TIMEOUT_S)
    d = RemoteDispatcher(cfg, cluster, torch.float32, "cpu")
    for conn in d.conns:  # NOTE: set by the dispatcher on a CUDA coordinator only
        conn.link_shape = (R, cfg.hidden_size, cfg.top_k)
    try:
        d.connect(60)
        d.begin_step(1)
        plan = d.link_plan(1)
        assert plan is not None, d.conns[0].link_note
        server, conn, lnk = plan
        assert conn.transport == "tcp" and lnk.host and lnk.dtype == conn.dtype
        co = Coordinator(conn._stream.fast)  # type: ignore[union-attr]
        sent = d.launch_link_step(server, conn, 1, 1, 1)
        assert not isinstance(sent, str) and sent() == "", sent  # a relayed link: answered when sent
        g = torch.Generator().manual_seed(7)
        for i, layer in enumerate(cfg.moe_layer_ids):
            x = torch.randn(1, cfg.hidden_size, generator=g).to(lnk.dtype)  # [1, H]
            experts = torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k].view(1, -1)  # [1, K]
            w = torch.rand(1, cfg.top_k, generator=g)  # [1, K]
            out, status = co.layer(1, i, x, d.link_table[i][experts], w)
            assert status == 0
            ws = [reader.expert_weights(layer, e) for e in range(cfg.num_experts)]
            w13 = torch.stack([e.w13 for e in ws]).double()  # [E, 2I, H]
            w2 = torch.stack([e.w2 for e in ws]).double()  # [E, H, I]
            ref = torch_moe(x.double(), w13, w2, experts, w.double())
            assert rel(out, ref) < 2e-2, rel(out, ref)
        # the next step: its first layer answered, then the server is killed
        d.begin_step(1)
        sent = d.launch_link_step(server, conn, 2, 1, 1)
        assert not isinstance(sent, str) and sent() == "", sent  # a relayed link: answered when sent
        x = torch.randn(1, cfg.hidden_size, generator=g).to(lnk.dtype)
        ids = d.link_table[0][:1].view(1, 1).expand(1, cfg.top_k).contiguous()
        w = torch.full((1, cfg.top_k), 0.5)
        assert co.layer(2, 0, x, ids, w)[1] == 0
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        t0 = time.monotonic()
        _, status = co.layer(2, 1, x, ids, w, timeout_s=TIMEOUT_S)
        assert status & ll.ERR_WIRE and time.monotonic() - t0 < TIMEOUT_S * tcp_relay.SERVER_RELAY
        d.link_failed(server, conn, status)
        assert "relay's TCP connection" in str(d.server_infos()[0]["last_error"])
    finally:
        d.close()
        srv.stop()
