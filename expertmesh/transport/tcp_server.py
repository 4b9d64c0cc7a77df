"""The expert server's end of the TCP data path (the protocol: :mod:`.tcp`).

:class:`DataListener`: one listening socket per server process (bound on the gRPC port's
host, port chosen by the server unless ``--data-port``), accepting in a thread of its own.
Each accepted connection gets a short-lived thread for its TLS handshake and preamble (a slow
or silent peer never holds up the next one); a preamble that names a stream waiting for its
connection hands the socket to that stream, anything else is dropped, logged and counted.

:class:`TcpServer`: one per ``Forward`` stream that asked for ``tcp``, with the interface of
the shared-memory :class:`~.server.ShmServer` (``start() -> Future[Ack]``, ``close()``). Its
thread waits for the coordinator's connection, then is the compute loop of that connection:
it reads a frame into its buffer, decodes it into an
:class:`~expertmesh.worker_api.ExpertRequest` (views into that buffer), hands it to
``forward_into`` (the worker core's checks + compute, the answer written straight into the
send buffer behind the response header) and sends header + answer with one ``sendall``.

Errors: a frame that does not parse is answered INVALID_ARGUMENT, a truncated one gets no
answer; either way the connection is dropped with a log line and a counted error, and the
server serves every other connection as before. A refused request (bad input, stale
generation, draining) is answered with its status and ends the connection too, as a refused
message ends a gRPC stream.

A relayed link (:mod:`.tcp_relay`): a Hello that offers ``relay`` gets a
:class:`~.tcp_relay.ServerRelay` (opened on this stream's thread before the Ack, which says
whether it took it); LinkStep frames on the data connection then launch the worker's step
compute and are answered code 0, or refused with their status while the connection goes on.

Shapes: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from expertmesh import errors
from expertmesh.transport import cuda_ipc, tcp
from expertmesh.transport import descriptor as dsc
from expertmesh.transport.handshake import Ack, Hello
from expertmesh.transport.layout import Views
from expertmesh.transport.spin import Spin
from expertmesh.transport.tcp_relay import ServerRelay
from expertmesh.worker_api import ExpertRequest

log = logging.getLogger("expertmesh.transport")

# reason -> why a data connection was dropped (the label of the dropped-connection counter)
DROP_REASONS = ("preamble", "malformed", "truncated", "tls")


class DataListener:
    """The server's data port: hands accepted, authenticated connections to their streams."""

    def __init__(
        self,
        host: str,
        port: int,
        tls_context: ssl.SSLContext | None,
        on_drop: Callable[[str], None] = lambda reason: None,  # counts a dropped connection
    ) -> None:
        self.tls = tls_context
        self.on_drop = on_drop
        self._sock = socket.create_server((host, port), family=_family(host), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._waiting: dict[bytes, Future[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="tcp-data-listener")
        self._thread.start()

    def expect(self, token: bytes) -> Future[socket.socket]:
        """The connection that will present ``token`` (single use)."""
        fut: Future[socket.socket] = Future()
        with self._lock:
            self._waiting[token] = fut
        return fut

    def forget(self, token: bytes) -> None:
        with self._lock:
            self._waiting.pop(token, None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # NOTE: e.g. EMFILE: do not spin on it
                continue
            threading.Thread(
                target=self._attach, args=(conn, peer), daemon=True, name="tcp-data-attach"
            ).start()

    def _attach(self, conn: socket.socket, peer: object) -> None:
        reason, why = "preamble", ""
        try:
            conn.settimeout(tcp.CONNECT_TIMEOUT_S)
            tcp.tune(conn)
            if self.tls is not None:
                reason = "tls"
                conn = self.tls.wrap_socket(conn, server_side=True)
                reason = "preamble"
            raw = bytearray(tcp.PREAMBLE.size)
            n = tcp.recv_into(conn, memoryview(raw))
            magic, token = tcp.PREAMBLE.unpack(raw) if n == len(raw) else (b"", b"")
            with self._lock:
                fut = self._waiting.pop(token, None) if magic == tcp.PREAMBLE_MAGIC else None
            if fut is None:
                why = (
                    f"a preamble of {n} bytes"
                    if n != len(raw) or magic != tcp.PREAMBLE_MAGIC
                    else "a token no stream is waiting for"
                )
            else:
                conn.sendall(tcp.ACCEPTED)
                conn.settimeout(None)
                if not fut.set_running_or_notify_cancel():
                    why = "its stream is gone"
                else:
                    fut.set_result(conn)
                    return
        except (OSError, ssl.SSLError) as e:
            why = f"{type(e).__name__}: {e}"
        log.warning("data port %d: dropped a connection from %s: %s", self.port, peer, why)
        self.on_drop(reason)
        with contextlib.suppress(OSError):
            conn.close()


def _linger(sock: socket.socket, timeout: float = 1.0, limit: int = 1 << 20) -> None:
    """Ends our side after an error answer and reads what the peer still sends (a frame body we
    will not parse) until it closes, for at most ``timeout`` s: closing with unread bytes would
    reset the connection, and the reset can discard the answer before the peer reads it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(timeout)
        end, seen = time.monotonic() + timeout, 0
        while seen < limit and time.monotonic() < end:
            chunk = sock.recv(65536)
            if not chunk:
                return
            seen += len(chunk)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class TcpServer:
    """One ``Forward`` stream's data connection and its compute loop (see the module text)."""

    def __init__(
        self,
        hello: Hello,
        listener: DataListener,
        device: torch.device,
        forward: Callable[[ExpertRequest], torch.Tensor],  # [T, H] on device; raises ExpertMeshError
        on_error: Callable[[str, errors.ExpertMeshError | None], None],  # a dropped connection
        spin_us: float = 0.0,  # how long to poll for the next frame before sleeping in recv
        forward_into: Callable[[ExpertRequest, torch.Tensor], None] | None = None,
        max_buffer: int = 256 << 20,
        link: Any = None,  # transport.server.LinkHost (the worker): serves a relayed link
        link_mode: str = "auto",  # transport.server.LINK_MODES
        relay_tally: Any = None,  # tcp_relay.RelayTally: the relays' counters for the metrics
    ) -> None:
        self.hello, self.listener, self.forward, self.on_error = hello, listener, forward, on_error
        self.forward_into = forward_into
        self.device = cuda_ipc.indexed(device)
        self.spin_us = spin_us
        self.capacity = min(hello.ring_bytes, max_buffer)
        self.token = bytes.fromhex(hello.token)
        self.ack: Future[Ack] = Future()
        self._conn_fut = listener.expect(self.token)
        self._sock: socket.socket | None = None
        self._state = threading.Lock()
        self._stop = False
        self.served = 0  # frames answered
        self.relay: ServerRelay | None = None
        if hello.relay is not None:
            self.relay = ServerRelay(hello.relay, listener, link, self.device, link_mode, relay_tally)
        self._thread = threading.Thread(target=self._run, daemon=True, name="expert-tcp-path")

    def _ack(self) -> Ack:
        tls = self.listener.tls is not None
        relay = self.relay.open() if self.relay is not None else {}
        return Ack("tcp", tcp={"port": self.listener.port, "tls": tls, "buffer": self.capacity}, relay=relay)

    def start(self) -> Future[Ack]:
        """The Ack: at once, or with a relay offered once this stream's thread opened it."""
        if self.relay is None:
            self.ack.set_result(self._ack())
        self._thread.start()
        return self.ack

    def close(self) -> None:
        """Ends the connection and the thread (any thread, any number of times)."""
        with self._state:
            self._stop = True
            sock = self._sock
        self.listener.forget(self.token)
        self._conn_fut.cancel()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.relay is not None:  # a step in flight ends now; the thread closes the relay
            self.relay.cancel()

    # ------------------------------------------------------------ the compute loop

    def _run(self) -> None:
        try:
            self._run_connection()
        finally:
            if self.relay is not None:  # NOTE: here, not on the event loop: it waits for the GPU
                self.relay.close()

    def _run_connection(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not self.ack.done():
            try:
                ack = self._ack()
            except Exception as e:  # noqa: BLE001  # NOTE: a thread's boundary: the handshake must get an answer
                log.exception("tcp data path set-up failed")
                ack = Ack("grpc", f"tcp data path set-up failed: {type(e).__name__}: {e}")
            self.ack.set_result(ack)
            if ack.transport != "tcp":
                self.close()
                return
        try:
            sock = self._conn_fut.result(timeout=tcp.CONNECT_TIMEOUT_S)
        except (FutureTimeout, CancelledError):  # the stream ended first, or nobody came
            self.listener.forget(self.token)
            if not self._stop:
                log.warning("tcp data path: the coordinator never connected (stream token unused)")
            return
        with self._state:
            if self._stop:
                sock.close()
                return
            self._sock = sock
        try:
            self._serve(sock)
        except Exception:  # noqa: BLE001  # NOTE: a thread's boundary: log, drop the connection
            log.exception("tcp data path failed")
            self.on_error("malformed", errors.Internal("tcp data path failed"))
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def _drop(self, reason: str, why: str, err: errors.ExpertMeshError | None = None) -> None:
        log.warning("tcp data path: dropped the connection: %s", why)
        self.on_error(reason, err)

    def _serve(self, sock: socket.socket) -> None:
        cap = self.capacity
        # NOTE: allocated once per connection, written in place per frame; pinned for DMA on CUDA
        pin = self.device.type == "cuda"
        rbuf = torch.empty(cap, dtype=torch.uint8, pin_memory=pin)  # a request's body
        wbuf = torch.empty(tcp.HEADER + cap, dtype=torch.uint8, pin_memory=pin)  # header + output
        self._loop(sock, rbuf, wbuf)

    def _loop(self, sock: socket.socket, rbuf: torch.Tensor, wbuf: torch.Tensor) -> None:
        cap = self.capacity
        rview, wview = rbuf.numpy().data, wbuf.numpy().data
        body_in, out_area = Views(rbuf), Views(wbuf[tcp.HEADER :])
        hdr = bytearray(tcp.HEADER)
        hview = memoryview(hdr)
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        spin = Spin(self.spin_us)
        tls = isinstance(sock, ssl.SSLSocket)

        def arrived() -> bool:
            return self._stop or bool(poll.poll(0)) or (tls and sock.pending() > 0)  # type: ignore[attr-defined]

        while not self._stop:
            if not spin.until(arrived):
                t0 = time.monotonic()
                got = tcp.recv_into(sock, hview)
                spin.blocked_for(time.monotonic() - t0)
            else:
                got = tcp.recv_into(sock, hview)
            if self._stop:
                return
            if got == 0:
                return  # the coordinator closed the connection between frames
            if got < tcp.HEADER:
                return self._drop("truncated", f"a frame header of {got} bytes, then end of stream")
            t0 = time.perf_counter()
            seq = 0
            try:
                if dsc.is_link_step(hdr):
                    self._link_step(sock, wview, dsc.LinkStep.parse(hdr), t0)
                    continue
                req = dsc.Request.parse(hdr, cap, 0)
                seq = req.seq
                route_off, body = tcp.body_layout(
                    req.tokens, req.hidden, req.top_k, req.hidden_dtype, req.has_adapters
                )
                if req.on_gpu or req.hidden_off or req.out_off or req.route_off != route_off or body > cap:
                    raise dsc.DescriptorError(
                        f"frame offsets hidden {req.hidden_off}, routing {req.route_off}, output "
                        f"{req.out_off} (want 0, {route_off}, 0; host memory only) or a body of "
                        f"{body} bytes past the {cap}-byte buffer"
                    )
            except dsc.DescriptorError as e:
                err = errors.InvalidRequest(f"invalid tcp frame: {e}")
                self._answer(sock, wview, dsc.Response(seq, err.status, 0.0, err.message), 0)
                self._drop("malformed", err.message, err)
                return _linger(sock)
            got = tcp.recv_into(sock, rview[:body])
            if got < body:
                return self._drop("truncated", f"a frame body of {got} of {body} bytes, then end of stream")
            t, h, k = req.tokens, req.hidden, req.top_k
            hidden = body_in.tensor(0, (t, h), req.hidden_dtype)
            slot_ids = body_in.tensor(route_off, (t, k), torch.int32)
            weights = body_in.tensor(route_off + t * k * 4, (t, k), torch.float32)
            adapters = (
                body_in.tensor(route_off + 2 * t * k * 4, (t,), torch.int32) if req.has_adapters else None
            )
            decoded = ExpertRequest(req.seq, req.generation, req.layer, hidden, slot_ids, weights, adapters)
            out = out_area.tensor(0, (t, h), req.out_dtype)
            try:
                if self.forward_into is not None:
                    self.forward_into(decoded, out)
                else:
                    out.copy_(self.forward(decoded))
                if self.device.type == "cuda":  # the answer is in host memory before it is sent
                    torch.cuda.current_stream(self.device).synchronize()
            except errors.ExpertMeshError as e:  # counted by the core already
                self._answer(sock, wview, dsc.Response(seq, e.status, 0.0, e.message), 0)
                log.info("tcp data path: request %d refused (%s); the connection ends", seq, e.message)
                return _linger(sock)
            self._answer(sock, wview, dsc.Response(seq, 0, (time.perf_counter() - t0) * 1e3), req.out_nbytes)
            self.served += 1

    def _link_step(self, sock: socket.socket, wview: memoryview, step: dsc.LinkStep, t0: float) -> None:
        """Launches a relayed step's compute; a refusal is answered and the connection goes on
        (the coordinator runs that step without the link)."""
        try:
            if self.relay is None:
                raise errors.Incompatible("no relayed link on this stream: the coordinator offered none")
            self.relay.link_step(step)
        except errors.ExpertMeshError as e:
            self._answer(sock, wview, dsc.Response(step.seq, e.status, 0.0, e.message), 0)
            return
        self._answer(sock, wview, dsc.Response(step.seq, 0, (time.perf_counter() - t0) * 1e3), 0)

    @staticmethod
    def _answer(sock: socket.socket, wview: memoryview, resp: dsc.Response, nbytes: int) -> None:
        wview[: tcp.HEADER] = resp.pack()
        with contextlib.suppress(OSError):  # the coordinator is gone: the next read ends the loop
            sock.sendall(wview[: tcp.HEADER + nbytes])
