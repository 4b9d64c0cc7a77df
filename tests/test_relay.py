"""The TCP relay (expertmesh/transport/relay.c): two relays over loopback between a Python
"graph" that writes request areas and flags and a Python "server compute" that polls the
server's request area and answers; every answer is checked against the same arithmetic done
here on the coordinator's inputs. Then bad frames, timeouts and aborts, against hand-written
peers."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from expertmesh.transport import link
from expertmesh.transport import relay as rl
from tests.relay_utils import DT, Compute, Graph, H, K, R, areas, connect, expected, pair


def test_the_relay_builds_here():
    """Every test below needs the relay's C build (a C compiler, as the CPU kernels do): where it
    cannot be built they fail, saying why here, rather than skip."""
    assert rl.load() is not None, rl.unavailable()


REQ, ANS = struct.Struct("<IIq"), struct.Struct("<IIqq")  # relay.c's frame headers
REQ_MAGIC, ANS_MAGIC = 0x31514D45, 0x31414D45


def test_host_areas_are_page_aligned_and_laid_out_as_link_says():
    span, req, ans = rl.host_areas(R, H, K, DT)
    assert span.data_ptr() % 4096 == 0 and req.data_ptr() == span.data_ptr()
    assert req.numel() == link.request_bytes(R, H, K, DT) and ans.numel() == link.answer_bytes(R, H, DT)
    assert ans.data_ptr() % 4096 == 0 and ans.data_ptr() >= req.data_ptr() + req.numel()
    assert ans.data_ptr() + ans.numel() <= span.data_ptr() + span.numel() and not span.any()


def run_steps(co: rl.Relay, srv: rl.Relay, steps: range, layers: int, rows: int, real: int) -> list[float]:
    compute, graph, times = Compute(srv), Graph(co, seed=steps.start), []
    for step in steps:
        worker = compute.run_step(step, rows, layers)
        assert co.step(step, rows, layers) == ""
        for i in range(layers):
            out, status, dt = graph.layer(step, i, rows, real)
            assert status == 0, f"step {step} layer {i}: status {status}"
            torch.testing.assert_close(out, graph.expect, rtol=0, atol=0)
            times.append(dt)
        worker.join(10)
        assert not compute.errors, compute.errors
    assert co.wait_idle(5)
    return times


def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "peer closed"
        buf += chunk
    return buf


@pytest.mark.parametrize("rows,real", [(1, 1), (R, 5)], ids=["rows1", "bucket8-padded"])
def test_answers_over_many_layers_and_steps(rows, real):
    with pair() as (co, srv, _):
        run_steps(co, srv, range(3, 7), layers=6, rows=rows, real=real)
        a, b = co.stats(), srv.stats()
    assert (a.steps, a.layers, a.last_step, a.last_bits) == (4, 24, 6, 0)
    assert b.layers == 24 and a.dropped == b.dropped == a.malformed == b.malformed == 0


def test_through_the_delay_proxy():
    with pair(delay_us=100.0) as (co, srv, _):
        times = run_steps(co, srv, range(1, 3), layers=4, rows=R, real=R)
    # NOTE: each layer crosses the proxy twice: at least two added one-way delays
    assert min(times) >= 200e-6, f"{min(times) * 1e6:.0f} us: the frames did not go through the proxy"


def test_step_refusals_say_why():
    with rl.Relay.coordinator(*areas(), R, H, K, DT) as co:
        assert co.step(1, 1, 4) == "the relay has no connection"
        assert "refused" in co.step(2, R + 1, 4)
    with pair() as (co, srv, listener):
        run_steps(co, srv, range(5, 6), layers=2, rows=1, real=1)
        assert "not after the last" in co.step(5, 1, 2)  # flag values never repeat on a link
        # one step may wait behind the running one; a third is refused
        assert co.step(6, 1, 2) == ""
        assert wait_for(lambda: co.step(7, 1, 2) == "")  # once the thread has taken step 6
        assert co.step(8, 1, 2) == "the relay's previous step has not ended"
        co.abort(7)  # ends the queued step and the running one before it
        assert co.wait_idle(2) and co.stats().last_step == 7 and co.stats().aborted == 2
        # the relay speaks plain TCP: a TLS socket is not taken
        c, s = connect(listener.getsockname()[1], listener)
        with (
            s,
            ssl.create_default_context().wrap_socket(
                c, server_hostname="x", do_handshake_on_connect=False
            ) as t,
            pytest.raises(ValueError, match="plain TCP"),
        ):
            srv.attach(t)


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<IIq", 0xDEADBEEF, 1, 1) + b"\0" * 64,  # not a request
        REQ.pack(REQ_MAGIC, R + 1, 1),  # more rows than the area
        REQ.pack(REQ_MAGIC, 1, 1) + b"\1" * 10,  # ends inside the payload
    ],
    ids=["garbage", "too-many-rows", "truncated"],
)
def test_a_bad_request_frame_drops_the_connection_and_the_server_relay_serves_the_next(frame):
    with pair() as (co, srv, listener):
        bad, bad_end = connect(listener.getsockname()[1], listener)
        assert not srv.attach(bad_end)  # it still has the good connection: refused, not queued
        co.close()  # the good peer goes away between frames: a clean close
        assert wait_for(lambda: not srv.connected)
        assert srv.attach(bad_end)
        bad.sendall(frame)
        with contextlib.suppress(OSError):  # the relay may have closed it already
            bad.shutdown(socket.SHUT_WR)
        assert wait_for(lambda: srv.stats().dropped == 1)
        assert (srv.stats().malformed, srv.stats().closed) == (1, 1)
        bad.close()
        with rl.Relay.coordinator(*areas(), R, H, K, DT) as co2:
            c, s = connect(listener.getsockname()[1], listener)
            assert srv.attach(s) and co2.attach(c)
            run_steps(co2, srv, range(1, 3), layers=3, rows=2, real=2)


def answer_badly(how: str, sock: socket.socket, rows: int) -> None:
    """A hand-written server that reads one request frame and answers it ``how``."""
    q = REQ.unpack(recv_exact(sock, REQ.size))
    recv_exact(sock, rows * H * 2 + 2 * rows * K * 4)
    body = b"\0" * (rows * H * 2)
    if how == "garbage":
        sock.sendall(ANS.pack(0x12345678, rows, q[2], 0) + body)
    elif how == "wrong-flag":
        sock.sendall(ANS.pack(ANS_MAGIC, rows, q[2] + 1, 0) + body)
    elif how == "truncated-close":
        sock.sendall(ANS.pack(ANS_MAGIC, rows, q[2], 0) + body[:10])
        sock.close()
    elif how == "silent":
        pass  # the socket stays open, nothing comes: the relay's timeout


@contextlib.contextmanager
def co_with_raw_peer(cfg: rl.RelayConfig) -> Iterator[tuple[rl.Relay, socket.socket, socket.socket]]:
    """A coordinator relay connected to a socket this test plays the server with:
    ``(relay, peer socket, listener)``."""
    with contextlib.ExitStack() as stack:
        co = stack.enter_context(rl.Relay.coordinator(*areas(), R, H, K, DT, cfg))
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        c, s = connect(listener.getsockname()[1], listener)
        stack.callback(s.close)
        assert co.attach(c)
        yield co, s, listener


def publish_in_micro_order(co: rl.Relay, step: int, layers: int, micro: int) -> list[int]:
    """Plays the graph of a micro-batched step that writes no payload: each request flag once
    that micro-batch's answer to the layer before is there; the status of every answer."""
    flag, ans_flag = co.req.flag.numpy(), co.ans.flag.numpy()
    base, statuses = step * link.STEP_SPAN, []

    def answered(k: int) -> None:
        end = time.monotonic() + 10
        while ans_flag[0] < base + k + 1:
            assert time.monotonic() < end, f"no answer to frame {k} (flag {ans_flag[0]})"
            time.sleep(0)
        statuses.append(int(co.ans.status[0]))

    n = layers * micro
    for k in range(n):
        if k >= micro:
            answered(k - micro)
        flag[0] = base + k + 1
    for k in range(n - micro, n):
        answered(k)
    return statuses


@pytest.mark.parametrize(
    "how,bit",
    [("garbage", rl.ERR_WIRE), ("wrong-flag", rl.ERR_WIRE), ("truncated-close", rl.ERR_WIRE), ("silent", 1)],
)
def test_a_bad_answer_ends_the_step_with_an_error_and_the_relay_takes_the_next_connection(how, bit):
    cfg = rl.RelayConfig(timeout_s=0.3)
    with contextlib.ExitStack() as stack:
        co, s, listener = stack.enter_context(co_with_raw_peer(cfg))
        peer = threading.Thread(target=answer_badly, args=(how, s, 2), daemon=True)
        peer.start()
        assert co.step(1, 2, 3) == ""
        graph = Graph(co)
        statuses = [graph.layer(1, i, 2)[1] for i in range(3)]
        # every layer of the step is answered (the graph runs through) and carries the bit
        assert all(st & bit for st in statuses), statuses
        assert co.wait_idle(5) and not co.connected
        st = co.stats()
        assert st.dropped == 1 and st.last_bits & bit
        assert (st.malformed, st.timeouts) == ((0, 1) if how == "silent" else (1, 0))
        peer.join(5)
        srv = stack.enter_context(rl.Relay.server(*areas(), R, H, K, DT, cfg))
        c, s = connect(listener.getsockname()[1], listener)
        assert srv.attach(s) and co.attach(c)
        run_steps(co, srv, range(2, 4), layers=3, rows=2, real=2)


def test_server_compute_silent_times_out_once_per_step_and_the_link_lives():
    cfg = rl.RelayConfig(timeout_s=0.3)
    # NOTE: the coordinator's relay waits longer than the server's: a silent compute is then
    # answered with ERR_TIMEOUT in time, not taken for a dead connection
    with pair(cfg, co_cfg=rl.RelayConfig(timeout_s=2.0)) as (co, srv, _):
        graph = Graph(co)
        assert co.step(1, 1, 8) == ""
        t0 = time.monotonic()
        statuses = [graph.layer(1, i, 1)[1] for i in range(8)]  # no compute runs step 1
        took = time.monotonic() - t0
        assert statuses == [link.ERR_TIMEOUT] * 8
        assert took < 4 * cfg.timeout_s, f"{took=}: one timeout per step, not one per layer"
        assert co.wait_idle(5) and co.connected and srv.stats().timeouts == 1
        run_steps(co, srv, range(2, 4), layers=4, rows=1, real=1)


def test_graph_that_never_writes_ends_the_step_after_the_timeout():
    cfg = rl.RelayConfig(timeout_s=0.2)
    with pair(cfg) as (co, srv, _):
        assert co.step(1, 1, 4) == ""
        assert co.wait_idle(2)
        st = co.stats()
        assert st.timeouts == 1 and st.last_bits == link.ERR_TIMEOUT and co.connected
        run_steps(co, srv, range(2, 3), layers=4, rows=1, real=1)


def test_abort_ends_the_step_at_once_on_both_ends():
    cfg = rl.RelayConfig(timeout_s=30.0)
    with pair(cfg) as (co, srv, _):
        assert co.step(1, 1, 4) == ""
        time.sleep(0.05)
        t0 = time.monotonic()
        co.abort(1)  # the coordinator's relay waits for a request flag that never comes
        assert co.wait_idle(2) and time.monotonic() - t0 < 1.0
        assert co.stats().aborted == 1 and co.stats().last_bits == link.ERR_TIMEOUT
        # the server's relay waits for a compute that never answers: aborted, it answers the error
        graph = Graph(co)
        assert co.step(2, 1, 2) == ""
        threading.Timer(0.1, srv.abort, args=(2,)).start()
        t0 = time.monotonic()
        assert [graph.layer(2, i, 1)[1] for i in range(2)] == [link.ERR_TIMEOUT] * 2
        assert time.monotonic() - t0 < 5.0 and srv.stats().aborted == 1
        assert co.wait_idle(2) and co.connected
        run_steps(co, srv, range(3, 4), layers=2, rows=1, real=1)


def test_without_a_compiler_the_reason_is_given(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("EXPERTMESH_CACHE", str(tmp_path))
    monkeypatch.setattr(rl._LIB, "_lib", None)
    monkeypatch.setattr(rl._LIB, "_why", "")
    assert rl.load() is None
    assert "cannot be built" in rl.unavailable() and "no-such-cc" in rl.unavailable()


# ---------------------------------------------------------------------- micro-batched steps


class MicroGraph:
    """The coordinator's graph of a micro-batched step (CausalLM.forward_micro's order): per
    layer, each micro-batch waits for its answer to the layer before, then writes its request
    in its own rows and publishes the flag; the waits take a flag at or past their own, as the
    graph's do (link.wait ``at_least``)."""

    def __init__(self, relay: rl.Relay, micro: int, rows: int, seed: int = 0) -> None:
        self.req, self.ans, self.micro, self.rows = relay.req, relay.ans, micro, rows
        self.flag, self.ans_flag = self.req.flag.numpy(), self.ans.flag.numpy()
        self.gen = torch.Generator().manual_seed(seed)

    def _answer(self, want: int, m: int, expect: torch.Tensor) -> int:
        end = time.monotonic() + 10
        while self.ans_flag[0] < want:
            assert time.monotonic() < end, f"no answer {want} (flag {self.ans_flag[0]})"
            time.sleep(0)
        rows = slice(m * self.rows, (m + 1) * self.rows)
        torch.testing.assert_close(self.ans.out[rows], expect, rtol=0, atol=0)
        return int(self.ans.status[0])

    def step(self, step: int, layers: int, dense: bool = False) -> list[int]:
        """``dense``: a dense layer between every two MoE layers, so every micro-batch's answer
        to a layer is waited for before the next layer's first request."""
        expect: list[torch.Tensor | None] = [None] * self.micro
        statuses = []
        for k in range(layers * self.micro):
            m, want = k % self.micro, step * link.STEP_SPAN + k + 1
            if dense and m == 0 and k:
                for j in range(self.micro):  # the dense layer needs all of them
                    statuses.append(self._answer(want - self.micro + j, j, expect[j]))
            elif not dense and expect[m] is not None:  # this micro-batch's answer to the layer before
                statuses.append(self._answer(want - self.micro, m, expect[m]))
            rows = slice(m * self.rows, (m + 1) * self.rows)
            x = torch.randn(self.rows, H, generator=self.gen).to(DT)
            ids = torch.randint(0, 16, (self.rows, K), generator=self.gen, dtype=torch.int32)
            w = torch.rand(self.rows, K, generator=self.gen)
            self.req.x[rows], self.req.ids[rows], self.req.w[rows] = x, ids, w
            expect[m] = expected(x, ids, w)
            self.flag[0] = want
        n = layers * self.micro
        for k in range(n - self.micro, n):
            m = k % self.micro
            statuses.append(self._answer(step * link.STEP_SPAN + k + 1, m, expect[m]))
        return statuses


@pytest.mark.parametrize(
    "micro,rows,dense", [(2, 4, False), (3, 2, False), (2, 1, False), (2, 2, True), (3, 1, True)]
)
def test_a_micro_batched_step_answers_each_micro_batch_in_its_rows(micro, rows, dense):
    with pair() as (co, srv, _):
        compute, graph = Compute(srv), MicroGraph(co, micro, rows, seed=micro)
        for step in (1, 2, 3):
            worker = compute.run_step(step, rows, 4 * micro)  # the server sees 4 x micro frames
            assert co.step(step, rows, 4, micro) == ""
            assert graph.step(step, 4, dense) == [0] * 4 * micro
            worker.join(10)
            assert not compute.errors, compute.errors
        assert co.wait_idle(5) and co.stats().layers == 3 * 4 * micro
        # a plain step after micro-batched ones, on the same link
        run_steps(co, srv, range(4, 5), layers=4, rows=R, real=R)


def test_a_micro_batched_step_has_micro_frames_in_flight():
    """The peer reads both micro-batches' first frames before it answers either: a relay that
    waited for each answer before the next frame would leave it waiting (then the step fails)."""
    micro, rows, layers = 2, 2, 3
    with co_with_raw_peer(rl.RelayConfig(timeout_s=2.0)) as (co, s, _):
        s.settimeout(5)
        frame = REQ.size + rows * H * DT.itemsize + 2 * rows * K * 4

        def peer() -> None:  # answers in pairs: both frames of a layer first, then both answers
            for _ in range(layers):
                got = [REQ.unpack(recv_exact(s, frame)[: REQ.size]) for _ in range(micro)]
                for _, n, flag in got:
                    x = torch.zeros(n, H, dtype=DT)
                    s.sendall(ANS.pack(ANS_MAGIC, n, flag, 0) + x.view(torch.uint8).numpy().tobytes())

        t = threading.Thread(target=peer, daemon=True)
        t.start()
        assert co.step(1, rows, layers, micro) == ""
        assert publish_in_micro_order(co, 1, layers, micro) == [0] * layers * micro
        assert co.wait_idle(5)
        t.join(5)
        st = co.stats()
        assert st.last_bits == 0 and st.layers == layers * micro and co.connected, st


def test_a_micro_batched_step_refuses_rows_past_the_areas():
    with pair() as (co, _, _):
        assert "refused" in co.step(1, R // 2 + 1, 2, 2)  # two micro-batches of R/2 + 1 rows
        assert "refused" in co.step(1, 1, 2, 0)
        assert co.step(1, R // 2, 2, 2) == ""


@pytest.mark.parametrize("how,bit", [("garbage", rl.ERR_WIRE), ("silent", 1)])
def test_a_bad_answer_in_a_micro_batched_step_answers_every_frame_with_the_bit(how, bit):
    """The peer answers the first frame badly (or not at all) while the other micro-batch's frame
    is out: every request of the step is answered with the bit (the graph runs through), the
    connection is dropped, and a plain step runs on the next connection."""
    micro, rows, layers = 2, 2, 3
    cfg = rl.RelayConfig(timeout_s=0.3)
    with co_with_raw_peer(cfg) as (co, s, listener):
        peer = threading.Thread(target=answer_badly, args=(how, s, rows), daemon=True)
        peer.start()
        assert co.step(1, rows, layers, micro) == ""
        statuses = publish_in_micro_order(co, 1, layers, micro)
        assert len(statuses) == layers * micro and all(st & bit for st in statuses), statuses
        assert co.wait_idle(5) and not co.connected
        st = co.stats()
        assert st.dropped == 1 and st.last_bits & bit, st
        peer.join(5)
        with rl.Relay.server(*areas(), R, H, K, DT, cfg) as srv:
            c, s2 = connect(listener.getsockname()[1], listener)
            assert srv.attach(s2) and co.attach(c)
            run_steps(co, srv, range(2, 4), layers=3, rows=2, real=2)
