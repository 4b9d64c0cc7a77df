"""The TCP data path against a live CPU expert server, below the coordinator: its answers are
the gRPC path's, bit for bit; malformed and truncated frames and bad preambles drop that
connection with a counted error while the server keeps serving; the cluster token guards the
handshake."""

from __future__ import annotations

import queue
import re
import socket
import time

import grpc
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from expertmesh import auth, wire
from expertmesh.health import check
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import tcp
from expertmesh.transport.errors import Rejected
from expertmesh.transport.handshake import Ack
from expertmesh.transport.tcp_client import TcpClient
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from expertmesh.worker_api import ExpertRequest
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint

pytestmark = pytest.mark.slow
TOKEN = "tcp-test-token"
H, K = 64, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3_moe", path)
    srv = start_server("cpu", path, 0, "--metrics-port", "0", "--cluster-token", TOKEN)
    for _ in range(300):
        if check(srv.address) == "SERVING":
            break
        time.sleep(0.1)
    m = re.search(r"metrics on (http://\S+)", srv.output())
    assert m, srv.output()
    ch = grpc.insecure_channel(srv.address)
    yield srv, pb_grpc.ExpertWorkerStub(ch), m.group(1)
    ch.close()
    srv.stop()


class Stream:
    """A raw Forward stream, driven by hand (seq 0: the handshake)."""

    def __init__(self, stub, token: str | None = TOKEN) -> None:
        self.q: queue.Queue = queue.Queue()
        self.call = stub.Forward(iter(self.q.get, None), metadata=auth.metadata(token))

    def handshake(self, hello: bytes) -> Ack:
        self.q.put(pb.ForwardRequest(seq=0, fast_path=hello))
        return Ack.decode(next(self.call).fast_path)

    def ask(self, msg: pb.ForwardRequest) -> torch.Tensor:
        self.q.put(msg)
        return wire.decode(next(self.call).output)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()


def connect(stub, token: str | None = TOKEN) -> tuple[Stream, TcpClient]:
    st = Stream(stub, token)
    client = TcpClient(1 << 20, torch.device("cpu"), server_host="127.0.0.1")
    ack = st.handshake(client.hello())
    assert ack.transport == "tcp", ack
    client.accept(ack)
    return st, client


def request(seq: int, t: int = 3, layer: int = 0, seed: int = 0, nan: bool = False) -> ExpertRequest:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.randint(-1, 8, (t, K), generator=g, dtype=torch.int32)
    w = torch.rand(t, K, generator=g)
    if nan:
        w[0, 0] = float("nan")
    return ExpertRequest(seq, 0, layer, x, ids, w)


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
    return total


def test_tcp_answers_equal_grpc_and_pipeline(server):
    srv, stub, _ = server
    st, client = connect(stub)
    plain = Stream(stub)
    try:
        reqs = [
            request(i + 1, t=t, layer=layer, seed=i) for i, (t, layer) in enumerate([(1, 0), (5, 2), (64, 0)])
        ]
        replies = [client.send(r, torch.float32) for r in reqs]  # three in flight at once
        assert all(r is not None for r in replies)
        for r, reply in zip(reqs, replies):
            assert reply is not None
            got = reply.result(10).clone()
            reply.release()
            want = plain.ask(wire.encode_request(r, torch.float32))
            assert torch.equal(got, want), r.seq
            assert reply.server_ms > 0
        # one answer abandoned, the next still right (the ring's space comes back)
        a = client.send(request(10, seed=10), torch.float32)
        b = client.send(request(11, seed=11), torch.float32)
        assert a is not None and b is not None
        a.abandon()
        assert torch.equal(b.result(10), plain.ask(wire.encode_request(request(11, seed=11), torch.float32)))
        b.release()
        assert client.ring.used == 0
    finally:
        client.close()
        st.close()
        plain.close()


def test_a_refused_request_ends_the_connection_with_its_status(server):
    _, stub, _ = server
    st, client = connect(stub)
    try:
        reply = client.send(request(1, nan=True), torch.float32)
        assert reply is not None
        with pytest.raises(Rejected) as ei:
            reply.result(10)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in ei.value.message
        assert client.dead
    finally:
        client.close()
        st.close()


def _raw_connection(stub) -> tuple[Stream, socket.socket]:
    """A stream whose data connection is ours to write bytes into."""
    st = Stream(stub)
    token = bytes(range(16))
    ack = st.handshake(
        f'EMHS1{{"transport": "tcp", "segment": "", "size": 0, "ring_offset": 0, "ring_bytes": 65536, "token": "{token.hex()}"}}'.encode()
    )
    assert ack.transport == "tcp", ack
    sock = socket.create_connection(("127.0.0.1", ack.tcp["port"]), timeout=10)
    sock.sendall(tcp.PREAMBLE.pack(tcp.PREAMBLE_MAGIC, token))
    assert sock.recv(8) == tcp.ACCEPTED
    return st, sock


def _good_frame(seq: int = 1) -> bytes:
    t = 2
    route_off, body = tcp.body_layout(t, H, K, torch.float32, False)
    desc = dsc.Request(seq, 0, 0, t, H, K, torch.float32, torch.float32, 0, route_off, 0)
    payload = bytearray(body)
    payload[route_off : route_off + t * K * 4] = torch.zeros(t, K, dtype=torch.int32).numpy().tobytes()
    return desc.pack() + bytes(payload)


@pytest.mark.parametrize(
    "case",
    ["corrupted_header", "truncated_header", "truncated_body", "offsets", "bad_preamble"],
)
def test_malformed_or_truncated_frames_drop_the_connection_and_serving_goes_on(server, case):
    _, stub, url = server
    errors_before = stub.Stats(pb.StatsRequest()).errors
    reason = {"corrupted_header": "malformed", "offsets": "malformed", "bad_preamble": "preamble"}.get(
        case, "truncated"
    )
    dropped_before = metric(url, "expertmesh_worker_data_connections_dropped_total", reason=reason)
    frame = _good_frame()
    if case == "bad_preamble":
        st = None
        sock = socket.create_connection(("127.0.0.1", _data_port(stub)), timeout=10)
        sock.sendall(tcp.PREAMBLE.pack(tcp.PREAMBLE_MAGIC, b"\x01" * 16))  # no stream expects it
    else:
        st, sock = _raw_connection(stub)
        if case == "corrupted_header":
            sock.sendall(frame[:40] + bytes([frame[40] ^ 0xFF]) + frame[41:])
        elif case == "truncated_header":
            sock.sendall(frame[:100])
            sock.shutdown(socket.SHUT_WR)
        elif case == "truncated_body":
            sock.sendall(frame[:-7])
            sock.shutdown(socket.SHUT_WR)
        else:  # a header whose body would overrun the connection's buffer
            bad = dsc.Request(1, 0, 0, 4096, H, K, torch.float32, torch.float32, 0, 4096 * H * 4, 0)
            sock.sendall(bad.pack())
    try:
        answer = b""
        while chunk := sock.recv(4096):  # the server closes the connection
            answer += chunk
        if case in ("corrupted_header", "offsets"):  # answered INVALID_ARGUMENT, then dropped
            resp = dsc.Response.parse(answer[: tcp.HEADER])
            assert resp.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
            assert "invalid tcp frame" in resp.message
        else:
            assert answer == b""
        deadline = time.monotonic() + 10
        while (
            metric(url, "expertmesh_worker_data_connections_dropped_total", reason=reason) == dropped_before
        ):
            assert time.monotonic() < deadline, case
            time.sleep(0.05)
        assert stub.Stats(pb.StatsRequest()).errors == errors_before + 1
    finally:
        sock.close()
        if st is not None:
            st.close()
    # the server serves a new connection as before
    st2, client = connect(stub)
    try:
        reply = client.send(request(1), torch.float32)
        assert reply is not None and reply.result(10).shape == (3, H)
    finally:
        client.close()
        st2.close()


def _data_port(stub) -> int:
    st, client = connect(stub)
    port = int(client.peer.rsplit(":", 1)[1])
    client.close()
    st.close()
    return port


def test_the_cluster_token_guards_the_handshake(server):
    _, stub, _ = server
    for token in (None, "wrong"):
        st = Stream(stub, token)
        try:
            client = TcpClient(1 << 20, torch.device("cpu"))
            ack = st.handshake(client.hello())
            assert ack.transport == "grpc" and "token" in ack.reason, ack
            client.close()
        finally:
            st.close()
    # a connection that knows no stream token gets nothing, even with the right cluster token
    st, client = connect(stub)
    client.close()
    st.close()
