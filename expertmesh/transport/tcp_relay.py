"""A link over the TCP data path: the relay (:mod:`.relay`) wired between a coordinator's
linked decode step and an expert server's step compute, on a second connection to the data
port.

Set-up (on the ``Forward`` stream's handshake, :mod:`.handshake`): a CUDA coordinator's tcp
Hello offers ``relay`` (:func:`offer`: the areas' shape, the MoE layers a step carries, the
server relay's timeout and a second token). The server (:class:`ServerRelay`) allocates its
own pair of host areas, opens the worker's link over them as if a coordinator had mapped them
(a CPU server's host-link C thread reads them in place; a GPU server's step graphs read and
answer them mapped into its GPU, expertmesh/transport/host_map.py), starts its relay end and
waits on the data listener for the connection that presents the token. The Ack says
``accepted`` or the ``reason``. The coordinator (:class:`ClientRelay`) connects, presents the
token and hands the socket to its relay end over its own host areas, which its decode graph
maps (coordinator/model/remote_graphs.py, a host link).

Per step: the coordinator sends the LinkStep on the data connection (tcp_client.py), the
server launches its compute and answers code 0, then the coordinator launches its relay end
for the step's MoE layers and replays its graph.

Timeouts nest so that each side hears of a failure from the one below it: the coordinator's
graph waits ``T`` (the cluster timeout), its relay end ``0.95 T``, the server's relay end
``0.9 T`` (in the offer), the server's compute ``0.8 T`` (the LinkStep's timeout, lowered by
the coordinator). A server that does not answer a layer in time is answered ERR_TIMEOUT by
its relay, which the coordinator's relay (still waiting) passes on.

TLS: the relay's C threads speak plain TCP, so with TLS configured no relay is offered or
accepted (the reason says so) and the data path stays on the encrypted Python frames.

Shapes: R rows of the areas, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from expertmesh import errors, wire
from expertmesh.tls import TLSConfig
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport import relay as rl
from expertmesh.transport import tcp
from expertmesh.transport.handshake import RELAY_MAX_LAYERS

log = logging.getLogger("expertmesh.transport")

# the fractions of the coordinator's timeout T each wait gets (the module text)
COORDINATOR_RELAY, SERVER_RELAY, SERVER_COMPUTE = 0.95, 0.9, 0.8
ATTACH_WAIT_S = 2.0  # a first step waits this long for the relay's connection to be handed over
TLS_REASON = (
    "TLS is configured: the relay's C threads speak plain TCP, so the link is not carried "
    "(the data path stays on the encrypted Python frames)"
)


def offer(
    rows: int, hidden: int, top_k: int, dtype: torch.dtype, layers: int, timeout_s: float, token: bytes
) -> dict:
    """The Hello's ``relay`` field (checked by handshake._check_relay)."""
    return {
        "rows": rows,
        "hidden": hidden,
        "top_k": top_k,
        "dtype": wire.dtype_name(dtype),
        "layers": layers,
        "timeout_ms": max(1, int(timeout_s * SERVER_RELAY * 1e3)),
        "token": token.hex(),
    }


def compute_timeout_ms(timeout_s: float) -> int:
    """The LinkStep timeout the coordinator sends: below both relays'."""
    return max(1, int(timeout_s * SERVER_COMPUTE * 1e3))


class RelayTally:
    """A server's relay counters for its metrics: the live relays' stats plus those of the
    relays already closed."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[rl.Relay] = weakref.WeakSet()
        self._gone = dict.fromkeys(_COUNTED, 0)
        self._lock = threading.Lock()

    def add(self, relay: rl.Relay) -> None:
        with self._lock:
            self._live.add(relay)

    def retire(self, relay: rl.Relay) -> None:
        """Before ``relay`` closes: its counts move to the closed relays'."""
        with self._lock:
            st = relay.stats()
            self._live.discard(relay)
            for name in _COUNTED:
                self._gone[name] += getattr(st, name)

    def totals(self) -> dict[str, int]:
        # NOTE: the live relays' stats under the lock: a relay is retired (under it) before it
        # closes, so none is freed while its stats are read
        with self._lock:
            out = dict(self._gone)
            for relay in list(self._live):
                with contextlib.suppress(RuntimeError):  # closed without being retired
                    st = relay.stats()
                    for name in _COUNTED:
                        out[name] += getattr(st, name)
        return out


_COUNTED = tuple(f.name for f in fields(rl.RelayStats) if not f.name.startswith("last_"))


@dataclass
class _Mapped:
    """The server's areas as its GPU sees them (a GPU server only)."""

    mapped: Any  # host_map.HostMapped over the span
    request: torch.Tensor  # uint8 on the GPU
    answer: torch.Tensor  # uint8 on the GPU


class ServerRelay:
    """The server's end of a relayed link on one ``Forward`` stream (see the module text).
    :meth:`open` once (never raises), then :meth:`link_step` per step from the data path's
    thread; :meth:`close` from any thread."""

    def __init__(
        self,
        relay_offer: dict,
        listener: Any,  # tcp_server.DataListener
        link_host: Any,  # transport.server.LinkHost (the worker), or None
        device: torch.device,
        link_mode: str = "auto",
        tally: RelayTally | None = None,
    ) -> None:
        self.offer, self.listener, self.link_host = relay_offer, listener, link_host
        self.device, self.link_mode, self.tally = device, link_mode, tally
        self.token = bytes.fromhex(relay_offer["token"])
        self.timeout_ms = int(relay_offer["timeout_ms"])
        self.relay: rl.Relay | None = None
        self.graphs: Any = None  # the worker's link (LinkHost.open_link)
        self.reason = ""
        self._mapped: _Mapped | None = None
        self._areas: tuple[torch.Tensor, ...] = ()
        self._conn: Future[socket.socket] | None = None
        self._lock = threading.Lock()
        self._attached = threading.Event()  # the relay's first connection came (or was refused)
        self._closed = False

    def open(self) -> dict:
        """The Ack's ``relay``: ``{"accepted": True, "micro_batches": N}`` (the most
        micro-batches a step may carry here; a server that predates them says nothing: 1) or
        ``{"reason": why}``."""
        try:
            why = self._open()
        except Exception as e:  # noqa: BLE001  # NOTE: a refused link must never fail the stream
            log.exception("relay set-up failed")
            why = f"{type(e).__name__}: {e}"
        if why:
            self.reason = f"no relayed link: {why}"
            log.info("tcp data path: %s", self.reason)
            self.close()
            return {"reason": self.reason}
        o = self.offer
        log.info("tcp data path: relayed link accepted (%d rows, top-k %d)", o["rows"], o["top_k"])
        # the most micro-batches a step of the offered layers may carry (flag values per step)
        micro = min(dsc.MAX_MICRO, RELAY_MAX_LAYERS // o["layers"])
        return {"accepted": True, "micro_batches": micro}

    def _open(self) -> str:
        if self.listener.tls is not None:
            return TLS_REASON
        if self.link_mode == "off":
            return "the link is off on this server (EXPERTMESH_LINK=0)"
        if self.link_host is None:
            return "this server serves no link"
        if rl.load() is None:
            return rl.unavailable()
        o = self.offer
        rows, hidden, top_k, dtype = o["rows"], o["hidden"], o["top_k"], wire.DTYPES[o["dtype"]]
        span, req, ans = rl.host_areas(rows, hidden, top_k, dtype)
        self._areas = (span, req, ans)
        mine_req, mine_ans = req, ans
        if self.device.type == "cuda":
            from expertmesh.transport.cuda_ipc import CudaIpcError
            from expertmesh.transport.host_map import HostMapped

            try:
                mapped = HostMapped(span, self.device)
            except (CudaIpcError, RuntimeError) as e:
                return f"cannot map the relay's areas into {self.device}: {e}"
            dev = mapped.tensor
            at = ans.data_ptr() - span.data_ptr()
            self._mapped = _Mapped(mapped, dev[: req.numel()], dev[at : at + ans.numel()])
            mine_req, mine_ans = self._mapped.request, self._mapped.answer
        try:
            self.graphs = self.link_host.open_link(
                mine_req, rows, top_k, answer=mine_ans, hidden=hidden, dtype=dtype, relayed=True
            )
        # NOTE: RuntimeError: torch's (CUDA, an allocation): the link only is refused
        except (errors.ExpertMeshError, RuntimeError) as e:
            return (
                f"the link could not be set up: {e.message if isinstance(e, errors.ExpertMeshError) else e}"
            )
        cfg = rl.RelayConfig(timeout_s=self.timeout_ms / 1e3)
        self.relay = rl.Relay.server(req, ans, rows, hidden, top_k, dtype, cfg)
        if self.tally is not None:
            self.tally.add(self.relay)
        self._conn = self.listener.expect(self.token)
        self._conn.add_done_callback(self._attach)
        return ""

    def _attach(self, fut: Future[socket.socket]) -> None:
        """The data listener's thread: the relay's connection arrived."""
        if fut.cancelled() or fut.exception() is not None:
            return
        sock = fut.result()
        with self._lock:
            ok = not self._closed and self.relay is not None and self.relay.attach(sock)
        self._attached.set()
        if not ok:
            log.warning("tcp data path: a second relay connection for one stream: dropped")
            with contextlib.suppress(OSError):
                sock.close()

    def link_step(self, step: dsc.LinkStep) -> None:
        """Launches the step's compute; typed errors refuse it (the stream goes on)."""
        relay = self.relay
        if relay is None or self.graphs is None:
            raise errors.Incompatible(self.reason or "no relayed link on this stream")
        # NOTE: the coordinator sends its first step once the listener accepted the relay's
        # token, which it does a moment before it hands the socket over here
        if not relay.connected and not (self._attached.wait(ATTACH_WAIT_S) and relay.connected):
            raise errors.Unavailable("the relay has no connection")
        if step.timeout_ms > self.timeout_ms:
            raise errors.InvalidRequest(
                f"link step timeout {step.timeout_ms} ms is not below the relay's {self.timeout_ms} ms: "
                "the relay would give up on a compute still waiting"
            )
        self.link_host.link_step(self.graphs, step)

    def cancel(self) -> None:
        """Ends the worker's step in flight at once (any thread): the stream is gone."""
        graphs = self.graphs
        if graphs is not None:
            self.link_host.cancel_link(graphs)

    def close(self) -> None:
        """Ends the step in flight, the relay, the worker's link and the areas' mapping, in
        that order (any thread, any number of times; it waits for the worker's last step)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            relay, self.relay = self.relay, None
            graphs, self.graphs = self.graphs, None
        if self._conn is not None:
            self.listener.forget(self.token)
            self._conn.cancel()
        if graphs is not None:
            self.link_host.cancel_link(graphs)
        if relay is not None:
            if self.tally is not None:
                self.tally.retire(relay)
            relay.close()
        if graphs is not None:
            self.link_host.close_link(graphs)  # NOTE: bounded: its waits were cancelled
        if self._mapped is not None:
            mapped, self._mapped = self._mapped, None
            try:
                mapped.mapped.close()
            except Exception:  # noqa: BLE001  # NOTE: teardown: nothing reads the areas now
                log.exception("could not unmap the relay's areas")
        self._areas = ()


class ClientRelay:
    """The coordinator's end: its host areas (the linked graph maps them), the relay end over
    them, and the second connection. Built when offering; :meth:`connect` after the Ack."""

    def __init__(
        self,
        rows: int,
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
        layers: int,
        timeout_s: float,
        tally: RelayTally | None = None,
    ) -> None:
        from expertmesh.transport.client import LinkAreas  # NOTE: the coordinator's type of a link

        self.layers, self.timeout_s = layers, timeout_s
        self.token = secrets.token_bytes(16)
        span, req, ans = rl.host_areas(rows, hidden, top_k, dtype)
        self._areas = (span, req, ans)
        self.link = LinkAreas(
            rows, hidden, top_k, dtype, ll.RequestViews.of(req, rows, hidden, top_k, dtype), req, host=True
        )
        cfg = rl.RelayConfig(timeout_s=timeout_s * COORDINATOR_RELAY)
        self.relay = rl.Relay.coordinator(req, ans, rows, hidden, top_k, dtype, cfg)
        self._alive = threading.Lock()
        self.tally = tally
        if tally is not None:
            tally.add(self.relay)

    @classmethod
    def make(
        cls,
        link: tuple[int, int, int, torch.dtype],
        layers: int,
        tls: TLSConfig | None,
        timeout_s: float,
        tally: RelayTally | None = None,
    ) -> tuple[ClientRelay | None, str]:
        """The coordinator's end to offer for a link of ``(R, H, K, dtype)``, or why none."""
        if tls is not None and tls.client_enabled:
            return None, TLS_REASON
        if not 0 < layers <= RELAY_MAX_LAYERS:
            return None, f"{layers} MoE layers: a relayed step carries 1..{RELAY_MAX_LAYERS}"
        if rl.load() is None:
            return None, rl.unavailable()
        try:
            return cls(*link, layers, timeout_s, tally), ""
        except (OSError, ValueError) as e:
            return None, f"the relay could not start: {e}"

    def offer(self) -> dict:
        lnk = self.link
        return offer(lnk.rows, lnk.hidden, lnk.top_k, lnk.dtype, self.layers, self.timeout_s, self.token)

    def connect(self, host: str, port: int) -> None:
        """The second connection, token presented, handed to the relay; the link is live
        after it. Raises TcpError."""
        peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=tcp.CONNECT_TIMEOUT_S)
        except OSError as e:
            raise tcp.TcpError(f"cannot connect the relay to the data port {peer}: {e}") from None
        try:
            tcp.tune(sock)
            sock.sendall(tcp.PREAMBLE.pack(tcp.PREAMBLE_MAGIC, self.token))
            got = bytearray(len(tcp.ACCEPTED))
            n = tcp.recv_into(sock, memoryview(got))
            if bytes(got[:n]) != tcp.ACCEPTED:
                raise tcp.TcpError(f"the data port {peer} did not accept the relay's token")
            if not self.relay.attach(sock):
                raise tcp.TcpError("the relay has a connection already")
        except OSError as e:
            sock.close()
            if isinstance(e, tcp.TcpError):
                raise
            raise tcp.TcpError(f"relay connection to {peer}: {type(e).__name__}: {e}") from None
        lnk, ans = self.link, self._areas[2]
        lnk.answer = ans
        lnk.ans = ll.AnswerViews.of(ans, lnk.rows, lnk.hidden, lnk.dtype)

    # NOTE: every call into the relay holds _alive (short calls), and close frees it under the
    # same lock: a kill from another thread never reaches a freed relay

    @property
    def live(self) -> bool:
        with self._alive:
            return self.link.ans is not None and not self.link.closed and self.relay.connected

    def step(self, step: int, bucket: int, micro: int = 1) -> str:
        """Launches the relay's end of a step the server launched (``micro`` micro-batches of
        ``bucket / micro`` rows); "" or why not."""
        with self._alive:
            if self.link.closed:
                return "the relay is closed"
            return self.relay.step(step, bucket // micro, self.layers, micro)

    def abort(self, step: int) -> None:
        with self._alive:
            if not self.link.closed:
                self.relay.abort(step)

    def close(self) -> None:
        """The caller holds the link's lock (no linked replay reads the areas): the relay's
        thread stops and the areas' mapping on our GPU (set by remote_graphs) is undone."""
        lnk = self.link
        with self._alive:
            if lnk.closed:
                return
            lnk.closed = True
            lnk.ans = None
            tally, self.tally = self.tally, None
            if tally is not None:
                tally.retire(self.relay)
            self.relay.close()
        mapped, lnk.mapped = lnk.mapped, None
        if mapped is not None:  # NOTE: unpinned before the memory goes (a later one there could not be)
            try:
                mapped.close()
            except Exception:  # noqa: BLE001  # NOTE: teardown: no graph reads the areas now
                log.exception("could not unmap the relay's areas")
