"""The TCP relay: a host link (link.py's request and answer areas, in host memory) carried
over one TCP connection by a C thread at each end (relay.c), with no Python per layer.

Why: the Python TCP data path (tcp_client.py / tcp_server.py) costs ~0.5 ms of Python on
both sides per MoE layer. With a host link the coordinator's graph writes each layer's request
into a host area and spins on the answer flag, and the server's compute (a C poller) reads a
host area: the relay moves those areas across the wire between the two, in C.

- ``Relay.coordinator(...)``: over the coordinator's own areas. :meth:`Relay.step` launches one
  decode step (``step``, ``rows``, MoE layer count) before the graph replays; per layer the
  thread spins on the request flag, sends the frame, reads the answer into the answer area and
  publishes its flag. A launch per step, not a relay that watches forever: the flag values of a
  step and its rows are known only then, and between steps the thread sleeps (no busy core).
- ``Relay.server(...)``: over the server's local areas. It runs as long as it has a
  connection, driven by the frames (each names its flag value and rows); the server's compute
  is launched per step by the control plane as for a local host link, so the relay needs no
  step of its own.

The connection is set up in Python (connect / accept and the token preamble of tcp.py, TLS
refused: the C thread speaks plain TCP) and handed over with :meth:`Relay.attach`, which takes
the socket. A frame that does not parse, a connection that ends inside a frame, or a peer
silent past the timeout closes it (counted in :meth:`Relay.stats`); the relay then waits for
the next :meth:`Relay.attach`. The coordinator end answers the rest of a failed step with
``ERR_WIRE`` / ``ERR_TIMEOUT`` in the status word, so its graph runs through and the host sees
the bits after the step (as for the device link).

Shapes: R rows of the areas, H hidden, K top-k.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import torch

from expertmesh.cbuild import CachedLibrary
from expertmesh.transport import link_layout as link

log = logging.getLogger("expertmesh.relay")

SOURCES = (Path(__file__).with_name("relay.c"), Path(__file__).with_name("relay_probe.c"))
FLAGS = ["-O2", "-fPIC", "-shared", "-pthread"]
ERR_WIRE = link.ERR_WIRE  # relay.c: the relay's connection failed or carried a bad frame
STATS = (
    "steps",
    "layers",
    "connects",
    "closed",
    "dropped",
    "malformed",
    "timeouts",
    "aborted",
    "last_step",
    "last_bits",
)
_ROLES = {"coordinator": 0, "server": 1}


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.relay_new.argtypes = [i, p, p, i64, i64]
    lib.relay_new.restype = p
    lib.relay_attach.argtypes = [p, i]
    lib.relay_connected.argtypes = [p]
    lib.relay_step.argtypes = [p, i64, i64, i64, i64]
    lib.relay_wait_idle.argtypes = [p, i64]
    lib.relay_abort.argtypes = [p, i64]
    lib.relay_abort.restype = None
    lib.relay_stats.argtypes = [p, p]
    lib.relay_stats.restype = None
    lib.relay_free.argtypes = [p]
    lib.relay_free.restype = None
    lib.probe_graph.argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, p]
    lib.probe_echo_start.argtypes = [p, i64, i64]
    lib.probe_echo_start.restype = p
    lib.probe_echo_stop.argtypes = [p]
    lib.probe_echo_stop.restype = None


_LIB = CachedLibrary("the TCP relay", "relay", SOURCES, FLAGS, _declare)
build, load, unavailable = _LIB.build, _LIB.load, _LIB.unavailable


_PAGE = 4096


def host_areas(
    rows: int, hidden: int, top_k: int, dtype: torch.dtype, pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One end's areas in one zeroed host allocation: ``(span, request, answer)``, the request
    area at the span's first page and the answer area at the next page boundary after it (the
    layout a coordinator maps into its GPU with one registration, as for a host link's shared
    memory: coordinator/model/remote_graphs.py). ``pin``: page-locked by torch (not needed for
    a registration of the span)."""
    req_n, ans_n = link.request_bytes(rows, hidden, top_k, dtype), link.answer_bytes(rows, hidden, dtype)
    ans_at = -(-req_n // _PAGE) * _PAGE
    n = ans_at + -(-ans_n // _PAGE) * _PAGE
    raw = torch.zeros(n + _PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % _PAGE  # the span starts on a page: registration works on pages
    span = raw[skip : skip + n]
    return span, span[:req_n], span[ans_at : ans_at + ans_n]


@dataclass(frozen=True)
class RelayConfig:
    # a wait inside an exchange, or for a flag, gives up after this. NOTE: give the coordinator
    # end a longer one than the server end: the server answers a silent compute with
    # ERR_TIMEOUT after its own, which the coordinator must still be there to read (else the
    # connection is dropped as silent too)
    timeout_s: float = 5.0
    # pause-spin on a flag (and poll the socket without blocking) this long before yielding the
    # core between polls (and blocking in recv). 0: yield from the first poll, which stays fast
    # where cores are free and lets a loaded host run the peer (benchmarks/bench_relay.py: on 2
    # busy cores 49 us per layer at 0 against 173 us at 20)
    spin_us: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"relay timeout {self.timeout_s} s: must be in (0, 3600]")
        if not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"relay spin {self.spin_us} us: must be in [0, 1e6]")


@dataclass(frozen=True)
class RelayStats:
    steps: int  # steps run to their end (coordinator end)
    layers: int  # layers answered by the peer
    connects: int  # connections attached
    closed: int  # connections the peer closed between frames
    dropped: int  # connections closed on an error
    malformed: int  # frames that did not parse or ended early
    timeouts: int  # waits that gave up
    aborted: int  # waits ended by :meth:`Relay.abort`
    last_step: int  # the last step run (coordinator end)
    last_bits: int  # its ERR_* bits: the relay's, ORed with the server's statuses


class Relay:
    """One end of a relayed host link; see the module text. Holds the areas while it lives."""

    def __init__(
        self,
        role: str,
        request: torch.Tensor,  # uint8, >= link.request_bytes(R, H, K, dtype), host memory
        answer: torch.Tensor,  # uint8, >= link.answer_bytes(R, H, dtype), host memory
        rows: int,  # R
        hidden: int,  # H
        top_k: int,  # K
        dtype: torch.dtype,
        config: RelayConfig | None = None,
    ) -> None:
        self._h: ctypes.c_void_p | None = None
        lib = load()
        if lib is None:
            raise OSError(unavailable())
        assert role in _ROLES, f"{role=}"
        assert request.device.type == "cpu" and answer.device.type == "cpu", "the relay reads host areas"
        self.config = config or RelayConfig()
        self.req = link.RequestViews.of(request, rows, hidden, top_k, dtype)
        self.ans = link.AnswerViews.of(answer, rows, hidden, dtype)
        self.rows, self.hidden, self.top_k, self.dtype = rows, hidden, top_k, dtype
        self._areas = (request, answer)  # NOTE: the C thread writes them: keep them alive
        req, ans = self.req, self.ans
        views = (req.flag, req.x, req.ids, req.w, ans.flag, ans.status, ans.out)
        ptrs = (ctypes.c_void_p * 7)(*(v.data_ptr() for v in views))
        dims = (ctypes.c_int64 * 4)(rows, hidden, top_k, dtype.itemsize)
        cfg = self.config
        handle = lib.relay_new(_ROLES[role], ptrs, dims, int(cfg.timeout_s * 1e9), int(cfg.spin_us * 1e3))
        if not handle:
            raise OSError(f"relay_new refused {rows=} {hidden=} {top_k=} {dtype=}, or no thread started")
        self._lib, self._h = lib, ctypes.c_void_p(handle)
        self.role = role

    @classmethod
    def coordinator(
        cls, request: torch.Tensor, answer: torch.Tensor, rows: int, hidden: int, top_k: int,
        dtype: torch.dtype, config: RelayConfig | None = None,
    ) -> Relay:  # fmt: skip
        return cls("coordinator", request, answer, rows, hidden, top_k, dtype, config)

    @classmethod
    def server(
        cls, request: torch.Tensor, answer: torch.Tensor, rows: int, hidden: int, top_k: int,
        dtype: torch.dtype, config: RelayConfig | None = None,
    ) -> Relay:  # fmt: skip
        return cls("server", request, answer, rows, hidden, top_k, dtype, config)

    def _handle(self) -> ctypes.c_void_p:
        if self._h is None:
            raise RuntimeError("the relay is closed")
        return self._h

    def attach(self, sock: socket.socket) -> bool:
        """Hands ``sock`` (connected, token exchanged) to the relay, which then owns it; False
        (``sock`` left open, the caller's) while the relay still has a connection."""
        if isinstance(sock, ssl.SSLSocket):
            raise ValueError("the relay speaks plain TCP: a TLS socket cannot be handed to it")
        rc = self._lib.relay_attach(self._handle(), sock.fileno())
        if rc == 0:
            sock.detach()
            return True
        return False

    @property
    def connected(self) -> bool:
        return bool(self._lib.relay_connected(self._handle()))

    def step(self, step: int, rows: int, layers: int, micro: int = 1) -> str:
        """Coordinator end: launches ``layers`` MoE layers of ``step`` at ``rows`` rows (the
        bucket: padding rows travel too). "" when launched, else why not (run the step without
        the link). ``micro`` > 1: a micro-batched step of ``layers * micro`` frames, frame
        ``i * micro + m`` micro-batch ``m``'s request of MoE layer ``i`` in rows ``[m * rows,
        (m + 1) * rows)`` of the areas, up to ``micro`` of them in flight (relay.c run_step)."""
        rc = self._lib.relay_step(self._handle(), step, rows, layers * micro, micro)
        if rc == 0:
            return ""
        if rc == -errno.ENOTCONN:
            return "the relay has no connection"
        if rc == -errno.EBUSY:
            return "the relay's previous step has not ended"
        return (
            f"the relay refused step {step} ({rows} rows, {layers} layers, {micro} micro-batches): "
            "not after the last or out of range"
        )

    def wait_idle(self, timeout_s: float) -> bool:
        """Coordinator end: True once no step is running or queued (False: timed out)."""
        return self._lib.relay_wait_idle(self._handle(), int(timeout_s * 1e9)) == 0

    def abort(self, step: int) -> None:
        """Ends every wait of ``step`` and of earlier steps at once, from any thread (the peer
        is gone). The coordinator end answers nothing more of those steps: cancel its graph's
        waits too (link.Canceller); the server end answers their frames with ``ERR_TIMEOUT``."""
        self._lib.relay_abort(self._handle(), step)

    def stats(self) -> RelayStats:
        out = (ctypes.c_int64 * len(STATS))()
        self._lib.relay_stats(self._handle(), out)
        return RelayStats(*out)

    def close(self) -> None:
        """Stops the thread (within one poll slice) and closes the connection."""
        if self._h is not None:
            h, self._h = self._h, None
            self._lib.relay_free(h)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
