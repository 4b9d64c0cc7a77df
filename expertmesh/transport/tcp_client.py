"""The coordinator's end of the TCP data path to one expert server (one per ``Forward``
stream; the protocol: :mod:`.tcp`). Same interface as the shared-memory
:class:`~.client.ShmClient`, so the connection (coordinator/expert_conn.py) treats both alike.

Per request: the hidden rows, routing block and header are written into one preallocated
send buffer and go out with one ``sendall`` on the caller's thread (the step's); the answer's
room is reserved in a receive ring (:mod:`.ring`) and the waiter reads the response straight
into it (``recv_into``), on its own thread, no hand-over. Answers come in request order.

Failures: a connection that breaks (the server died) or an answer that does not parse kills
the channel with UNAVAILABLE (a server fault: the rows fail over to live replicas); a refused
request kills it with the server's status; a server that stops answering is a timeout
(``FutureTimeout``), and one that stalls inside a frame kills the channel too (the byte
stream cannot be resynchronised).

A link (``link=(R, H, K, dtype)`` and the MoE layer count) is offered as a relay
(:mod:`.tcp_relay`): once the server took it, :attr:`TcpClient.link` is a host link over this
side's areas, :meth:`TcpClient.link_step` sends each step's LinkStep as a frame on the data
connection and launches the relay's end after the server's answer.

Shapes: T tokens sent to this server, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from expertmesh import errors
from expertmesh.tls import TLSConfig
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import tcp
from expertmesh.transport.errors import MalformedAnswer, Rejected
from expertmesh.transport.handshake import Ack, Hello
from expertmesh.transport.layout import Views
from expertmesh.transport.ring import Region, Ring
from expertmesh.transport.spin import Spin
from expertmesh.worker_api import ExpertRequest

if TYPE_CHECKING:
    from expertmesh.transport.client import LinkAreas
    from expertmesh.transport.tcp_relay import ClientRelay


@dataclass
class TcpReply:
    """One request in flight on the TCP path."""

    channel: TcpClient
    seq: int
    out: torch.Tensor  # [T, H] in the receive ring, where the answer lands ([0]: a LinkStep's)
    region: Region | None
    send_s: float = 0.0  # the coordinator's time to encode and send it
    server_ms: float = 0.0  # the server's time from reading the frame to answering
    done_at: float = 0.0  # perf_counter when the answer was read (or 0)
    sent_at: float = 0.0  # perf_counter when the frame was handed to the kernel

    def result(self, timeout: float) -> torch.Tensor:
        """The output ``[T, H]`` (a view into the ring: use it before :meth:`release`).

        Raises FutureTimeout after ``timeout`` seconds, Rejected if the server refused the
        request or the connection died."""
        self.server_ms = self.channel.wait(self.seq, time.monotonic() + timeout).compute_ms
        return self.out

    def release(self) -> None:
        if self.region is not None and not self.region.freed:
            self.channel.ring.free(self.region)

    def abandon(self) -> None:
        self.channel.abandon(self)


class TcpClient:
    transport = "tcp"
    gpu = False

    def __init__(
        self,
        buffer_bytes: int,
        device: torch.device,
        spin_us: float = 0.0,
        tls: TLSConfig | None = None,
        data_address: str = "",  # HOST:PORT to connect to instead of the advertised port
        server_host: str = "127.0.0.1",  # the host of the server's gRPC address
        stall_s: float = 30.0,  # the longest a frame may take to arrive or leave once started
        # offer a relayed link: (R, H, K, dtype) of its areas and the MoE layers of a step; its
        # waits nest under ``stall_s``, the cluster timeout the linked graph waits (tcp_relay.py)
        link: tuple[int, int, int, torch.dtype] | None = None,
        link_layers: int = 0,
        relay_tally: Any = None,  # tcp_relay.RelayTally: the relay's counters, kept past this channel
    ) -> None:
        self.capacity = buffer_bytes
        self.stall_s = stall_s
        self.device = device
        self.tls, self.data_address, self.server_host = tls, data_address, server_host
        self._token = np.random.bytes(16)
        self._sock: socket.socket | None = None
        pin = device.type == "cuda"  # NOTE: answers and hidden states cross by DMA, once pinned
        self._wbuf = torch.empty(tcp.HEADER + buffer_bytes, dtype=torch.uint8, pin_memory=pin)
        self._wview = self._wbuf.numpy().data
        self._wnp = self._wbuf.numpy()
        self._send_area = Views(self._wbuf)
        self._rbuf = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin)
        self._rview = self._rbuf.numpy().data
        self._recv_area = Views(self._rbuf)
        self.ring = Ring(buffer_bytes, align=64)
        self._hdr = bytearray(tcp.HEADER)
        self._order: deque[TcpReply] = deque()  # sent, not yet answered, in order
        self._answers: dict[int, dsc.Response] = {}  # read before their waiter asked
        self._orphans: set[int] = set()  # abandoned: freed when their answer arrives
        self._lock = threading.Lock()  # held by a waiter while it reads the socket
        self._state = threading.Lock()
        self._dead: Rejected | None = None
        self._closed = False
        self._spin = Spin(spin_us)
        self._poll = select.poll()
        self.peer = ""
        self._relay: ClientRelay | None = None
        self._link_seqs: set[int] = set()  # LinkSteps awaiting their answer: a refusal is no failure
        self.link_reason = "not offered"
        if link is not None:
            from expertmesh.transport.tcp_relay import ClientRelay

            self._relay, self.link_reason = ClientRelay.make(link, link_layers, tls, stall_s, relay_tally)

    @property
    def link(self) -> LinkAreas | None:
        """The live relayed link (None: none, or the channel or its relay connection died)."""
        r = self._relay
        return r.link if r is not None and r.live and self._dead is None else None

    # ------------------------------------------------------------ handshake

    def hello(self) -> bytes:
        relay = self._relay.offer() if self._relay is not None else None
        return Hello("tcp", "", 0, 0, self.capacity, self._token.hex(), relay=relay).encode()

    def accept(self, ack: Ack) -> None:
        """Connects to the server's data port and presents the stream token; raises TcpError
        (saying why) when that fails."""
        assert ack.transport == "tcp", ack
        limit = ack.tcp.get("buffer")
        if isinstance(limit, int) and 0 < limit < self.capacity:  # the server holds less: send less
            self.capacity = limit
        if self.data_address:
            host, port = tcp.split_address(self.data_address)
        else:
            host, port = self.server_host, int(ack.tcp["port"])
        self.peer = f"{host}:{port}"
        ctx = tcp.client_context(self.tls)
        if ack.tcp.get("tls") and ctx is None:
            raise tcp.TcpError(
                f"the data port {self.peer} speaks TLS and this coordinator has no --tls-* settings"
            )
        if ctx is not None and not ack.tcp.get("tls"):
            raise tcp.TcpError(
                f"TLS is configured here but the server's data port {self.peer} is plaintext: refused"
            )
        try:
            sock = socket.create_connection((host, port), timeout=tcp.CONNECT_TIMEOUT_S)
        except OSError as e:
            raise tcp.TcpError(f"cannot connect to the data port {self.peer}: {e}") from None
        try:
            tcp.tune(sock)
            if ctx is not None:
                name = (self.tls.server_name if self.tls is not None else None) or host
                sock = ctx.wrap_socket(sock, server_hostname=name)
            sock.sendall(tcp.PREAMBLE.pack(tcp.PREAMBLE_MAGIC, self._token))
            got = bytearray(len(tcp.ACCEPTED))
            n = tcp.recv_into(sock, memoryview(got))
            if bytes(got[:n]) != tcp.ACCEPTED:
                raise tcp.TcpError(f"the data port {self.peer} did not accept this stream's token")
        except (OSError, ssl.SSLError) as e:
            sock.close()
            if isinstance(e, tcp.TcpError):
                raise
            raise tcp.TcpError(f"data port {self.peer}: {type(e).__name__}: {e}") from None
        # NOTE: set once (each change costs a system call): a waiter polls for its answer with
        # its own deadline first; this bounds a frame that stops half-way, and a send
        sock.settimeout(self.stall_s)
        with self._state:
            if self._dead is not None:
                sock.close()
                raise tcp.TcpError(f"the channel closed while connecting: {self._dead.message}")
            self._sock = sock
        self._poll.register(sock, select.POLLIN)
        if self._relay is not None:
            self._accept_relay(ack, host, port)

    def _accept_relay(self, ack: Ack, host: str, port: int) -> None:
        """Connects the relay when the server took it; a failure leaves the data path up
        without the link (the reason says why)."""
        assert self._relay is not None
        relay, why = self._relay, ""
        if ack.relay.get("accepted") is not True:
            why = str(ack.relay.get("reason") or "the server did not take the relayed link")
        else:
            try:
                relay.connect(host, port)
            except tcp.TcpError as e:
                why = str(e)
            micro = ack.relay.get("micro_batches", 1)  # a server that predates them: none
            relay.link.micro = micro if isinstance(micro, int) and 1 <= micro <= dsc.MAX_MICRO else 1
        self.link_reason = why
        if why:
            self._relay = None
            relay.close()

    # ------------------------------------------------------------ data path

    def stage(self, x: torch.Tensor, dtype: torch.dtype, top_k: int) -> bool:
        return False  # nothing to gain: the hidden states are copied when they are sent

    def send(self, req: ExpertRequest, dtype: torch.dtype) -> TcpReply | None:
        """This path's codec: sends ``req`` (hidden cast to the server's compute ``dtype``);
        None when it does not fit the buffers now (send it over gRPC)."""
        t0 = time.perf_counter()
        x, rows, slot_ids = req.hidden, req.rows, req.slot_ids
        t, k = slot_ids.shape
        h = x.shape[1]
        adapters = req.adapter_slots
        route_off, body = tcp.body_layout(t, h, k, dtype, adapters is not None)
        if body > self.capacity or (self._order and tcp.HEADER + body > tcp.PIPELINED_MAX_BYTES):
            return None
        region = self.ring.alloc(t * h * dtype.itemsize)
        if region is None:
            return None
        area = self._send_area
        hidden = area.tensor(tcp.HEADER, (t, h), dtype)  # [T, H]
        if rows is None or t == x.shape[0]:  # every row of the step (rows are sorted and unique)
            hidden.copy_(x)
        elif x.device == hidden.device and x.dtype == dtype:
            torch.index_select(x, 0, rows, out=hidden)
        else:
            hidden.copy_(x.index_select(0, rows.to(x.device)))
        base = tcp.HEADER + route_off
        tk = t * k
        self._wnp[base : base + tk * 4].view(np.int32)[:] = slot_ids.numpy().ravel()
        self._wnp[base + tk * 4 : base + 2 * tk * 4].view(np.float32)[:] = weights_f32(req.weights).ravel()
        flags = 0
        if adapters is not None:
            self._wnp[base + 2 * tk * 4 : base + 2 * tk * 4 + t * 4].view(np.int32)[:] = adapters.numpy()
            flags = dsc.FLAG_ADAPTERS
        desc = dsc.Request(req.seq, req.generation, req.layer, t, h, k, dtype, dtype, 0, route_off, 0, flags)
        self._wview[: tcp.HEADER] = desc.pack()
        out = self._recv_area.tensor(region.offset, (t, h), dtype)
        reply = TcpReply(self, req.seq, out, region)
        # NOTE: no lock: only this thread appends and only a waiter pops (deque ops are atomic),
        # and a waiter may hold the read lock for as long as its answer takes
        self._order.append(reply)
        sock = self._sock
        try:
            if self._dead is not None or sock is None:
                raise OSError("the channel is closed")
            sock.sendall(self._wview[: tcp.HEADER + body])
        except OSError as e:
            self.kill(self._lost(f"sending failed: {e}"))
        reply.sent_at = time.perf_counter()
        reply.send_s = reply.sent_at - t0
        return reply

    def _lost(self, what: str) -> Rejected:
        return Rejected(errors.Unavailable(f"tcp data connection to {self.peer}: {what}"))

    def _readable(self) -> bool:
        sock = self._sock
        if self._dead is not None or sock is None:
            return True
        return bool(self._poll.poll(0)) or (isinstance(sock, ssl.SSLSocket) and sock.pending() > 0)

    def wait(self, seq: int, deadline: float) -> dsc.Response:
        with self._lock:
            while True:
                r = self._answers.pop(seq, None)
                if r is not None:
                    return r
                if self._dead is not None:
                    raise self._dead
                left = deadline - time.monotonic()
                if left <= 0:
                    # NOTE: an answer that already arrived is read before giving up (a layer's
                    # later servers are collected with what an earlier, slow one left)
                    if not self._readable():
                        raise FutureTimeout()
                elif not self._spin.until(self._readable):
                    t0 = time.monotonic()
                    if not self._poll.poll(max(1, int(left * 1e3))):
                        continue
                    self._spin.blocked_for(time.monotonic() - t0)
                self._read_one()

    def _read_one(self) -> None:
        """Reads one answer (the oldest request's), into its room in the ring."""
        sock = self._sock
        if self._dead is not None or sock is None:
            return
        hv = memoryview(self._hdr)
        try:
            n = tcp.recv_into(sock, hv)
            if n < tcp.HEADER:
                self.kill(
                    self._lost("closed by the server" if n == 0 else f"closed inside an answer ({n} bytes)")
                )
                return
            try:
                r = dsc.Response.parse(self._hdr)
            except dsc.DescriptorError as e:
                self.kill(Rejected(MalformedAnswer(f"bad tcp answer header from {self.peer}: {e}")))
                return
            if r.code and r.seq not in self._link_seqs:  # the server stops serving after an error
                self.kill(Rejected(errors.from_status(r.code, r.message)))
                return
            if not self._order or self._order[0].seq != r.seq:
                want = self._order[0].seq if self._order else None
                self.kill(Rejected(MalformedAnswer(f"an answer for seq {r.seq}, expected {want}")))
                return
            reply = self._order.popleft()
            nbytes = reply.out.nbytes
            off = reply.region.offset if reply.region is not None else 0  # None: a LinkStep's, no body
            if nbytes and tcp.recv_into(sock, self._rview[off : off + nbytes]) < nbytes:
                self.kill(self._lost("closed inside an answer"))
                return
        except TimeoutError:
            self.kill(
                Rejected(
                    errors.DeadlineExceeded(f"tcp data connection to {self.peer}: stalled inside an answer")
                )
            )
            return
        except OSError as e:
            self.kill(self._lost(str(e)))
            return
        reply.done_at = time.perf_counter()
        if r.seq in self._orphans:
            self._orphans.discard(r.seq)
            reply.release()
        else:
            self._answers[r.seq] = r

    def abandon(self, reply: TcpReply) -> None:
        with self._lock:
            if self._dead is not None:
                return  # nothing more arrives; the buffers go with the channel
            if self._answers.pop(reply.seq, None) is not None:
                reply.release()
            elif any(r is reply for r in self._order):
                self._orphans.add(reply.seq)
            else:
                reply.release()

    # ------------------------------------------------------------ teardown

    def link_step(self, step: dsc.LinkStep, deadline: float) -> dsc.Response:
        """Sends a LinkStep frame (its timeout lowered below the relays', tcp_relay.py) and
        waits for its answer; on code 0 (the server launched its compute) launches the relay's
        end of the step. A refusal is returned, the channel lives on. Raises FutureTimeout
        past ``deadline``, Rejected if the channel died (or the relay could not take the step
        the server launched: the channel is killed, which ends the server's step too)."""
        from expertmesh.transport import tcp_relay

        relay = self._relay
        if self._dead is not None:
            raise self._dead
        if relay is None:
            raise Rejected(errors.Incompatible(f"no relayed link on this channel: {self.link_reason}"))
        step = replace(step, timeout_ms=min(step.timeout_ms, tcp_relay.compute_timeout_ms(self.stall_s)))
        reply = TcpReply(self, step.seq, self._rbuf[:0], None)
        self._link_seqs.add(step.seq)
        self._order.append(reply)
        sock = self._sock
        try:
            if sock is None:
                raise OSError("the channel is closed")
            sock.sendall(step.pack())
        except OSError as e:
            self.kill(self._lost(f"sending a link step failed: {e}"))
        try:
            resp = self.wait(step.seq, deadline)
        finally:
            self._link_seqs.discard(step.seq)
        if resp.code == 0:
            why = relay.step(step.step, step.bucket, step.micro)
            if why:
                self.kill(self._lost(f"the relay could not take step {step.step}: {why}"))
                assert self._dead is not None
                raise self._dead
        return resp

    def kill(self, err: Rejected) -> None:
        """Fails every present and future wait with ``err`` (any thread)."""
        with self._state:
            if self._dead is not None:
                return
            self._dead = err
            sock = self._sock
        if sock is not None:  # wakes a waiter blocked on the socket
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        relay = self._relay
        if relay is not None:  # a step in flight ends now, not at its timeout
            last = relay.link.next_step - 1  # NOTE: the last step handed out: in flight, or done
            if relay.link.cancel is not None:
                relay.link.cancel(last)  # the linked graph's waits
            relay.abort(last)

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def error(self) -> Rejected | None:
        return self._dead

    def close(self) -> None:
        self.kill(Rejected(errors.Cancelled("tcp data path closed")))
        relay = self._relay
        # NOTE: the link's lock first (a linked step holds it, then this channel's lock while it
        # waits for its answer): a graph that may still read the areas ends first
        with relay.link.lock if relay is not None else contextlib.nullcontext(), self._lock, self._state:
            if self._closed:
                return
            self._closed = True
            if relay is not None:
                relay.close()
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()


def weights_f32(w: torch.Tensor) -> np.ndarray:
    """``w [T, K]`` as float32 numpy (no copy when it is float32 on the host already)."""
    return (w if w.dtype == torch.float32 else w.float()).numpy()
