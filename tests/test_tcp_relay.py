"""The relayed link over the TCP data path (expertmesh/transport/tcp_relay.py) on the CPU: a real
TcpClient offering it, a real TcpServer and CPU worker (its host-link C thread) taking it, and
this test as the coordinator's graph (per layer: write the request area, bump its flag, spin on
the answer flag). Answers must equal the CPU backend's ``forward`` bit for bit; a server killed
with SIGKILL mid-step gives the step an error status at once; a malformed relay frame or
LinkStep drops that connection, counted, while the server serves on; TLS refuses the relay."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport import relay as rl
from expertmesh.transport import tcp, tcp_relay
from expertmesh.transport.errors import Rejected
from expertmesh.transport.handshake import Ack, HandshakeError, Hello
from expertmesh.transport.tcp_client import TcpClient
from expertmesh.transport.tcp_server import DataListener, TcpServer
from expertmesh.worker.core import ExpertWorker
from expertmesh.worker_api import ExpertRequest
from tests.test_hostlink import CPU, DT, H, K, R, inputs, make_worker
from tests.tls_utils import CA

pytestmark = pytest.mark.skipif(rl.load() is None, reason=rl.unavailable() or "no relay")

LAYERS = 2  # tests/test_hostlink.py's checkpoint
TIMEOUT_S = 5.0  # the cluster timeout the test's coordinator runs with


class Coordinator:
    """The coordinator's side: the real TcpClient and its relayed link's areas, written and
    polled as the linked graph would (payload first, then the flag)."""

    def __init__(self, client: TcpClient) -> None:
        self.client = client
        self.seq = itertools.count(1)

    @property
    def lnk(self):
        lnk = self.client.link
        assert lnk is not None and lnk.host, self.client.link_reason
        return lnk

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
        assert ack.relay == {"accepted": True}, ack
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
        assert ack.relay == {"accepted": True}
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


def test_sigkill_of_the_server_mid_step_gives_an_error_status_not_a_hang():
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.relay_server"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    c = client()
    co = Coordinator(c)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write(c.hello().hex() + "\n")
        child.stdin.flush()
        ack = Ack.decode(bytes.fromhex(child.stdout.readline().strip()))
        assert ack.relay == {"accepted": True}, ack
        c.accept(ack)
        assert co.launch(1, 1, 1).code == 0
        x, ids, w = inputs(1, 1, seed=5)
        out, status = co.layer(1, 0, x, ids, w)
        assert status == 0 and out.any()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        out, status = co.layer(1, 1, x, ids, w, timeout_s=TIMEOUT_S)
        assert status & ll.ERR_WIRE, f"status {status}"
        assert time.monotonic() - t0 < TIMEOUT_S * tcp_relay.COORDINATOR_RELAY
        assert c.link is None, "a relay without its connection is no live link"
    finally:
        c.close()
        if child.poll() is None:
            child.kill()
        child.wait(10)
