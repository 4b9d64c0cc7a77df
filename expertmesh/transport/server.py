"""The expert server's end of a fast-path channel: one thread per ``Forward`` stream that asked
for one.

The thread maps the coordinator's segment (and unlinks its name at once), opens the FIFOs,
with ``cuda_ipc`` maps the coordinator's GPU ring and shares its own output ring, and answers
the handshake. Then it reads request descriptors, decodes each into an
:class:`~expertmesh.worker_api.ExpertRequest` (:meth:`ShmServer._decode`, this path's codec),
hands it to ``forward`` (the worker core's checks + compute, serialised with the gRPC path
there) and writes the output and a response descriptor. A bad descriptor or a refused request is answered with its status
and ends the channel, as a bad message ends a gRPC stream; the stream's handler calls
:meth:`ShmServer.close` when the stream ends, whoever ended it.

Device link (expertmesh/transport/link.py): a ``cuda_ipc`` hello may offer the
coordinator's request area. The thread maps it, has the worker build the step graphs
(``LinkHost.open_link``; gpu_server/link_graphs.py) and shares their answer area in the Ack
(``link_area``), or says why not (``link_reason``). A :class:`~descriptor.LinkStep`
descriptor then launches one step's graph (``LinkHost.link_step``) and is answered code 0
once it is launched; a refused step (draining, another generation, an unknown bucket) gets
its status and message and the channel goes on (the coordinator runs that step without the
link). Only a LinkStep that does not parse ends the channel.

Host link (cpu_expert_server/hostlink.py): a ``shm`` hello may offer request and answer
areas after the ring in the coordinator's segment. The thread has the worker open a C poller
over them (``LinkHost.open_link`` with ``answer``) and says so in the Ack's ``host_link``
(``accepted``, or the ``reason`` why not); LinkStep descriptors then work as above.

Shapes: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import torch

from expertmesh import errors, wire
from expertmesh.net import device_uuid
from expertmesh.transport import cuda_ipc, segment
from expertmesh.transport import descriptor as dsc
from expertmesh.transport.handshake import Ack, Hello
from expertmesh.transport.layout import (
    HEADER,
    REQUESTS_WORD,
    RESPONSES_WORD,
    SEGMENT_MAGIC,
    Views,
    header_words,
)
from expertmesh.transport.link_layout import host_areas
from expertmesh.transport.spin import Spin
from expertmesh.worker_api import ExpertRequest

log = logging.getLogger("expertmesh.transport")

LINK_MODES = ("auto", "force", "off")  # EXPERTMESH_LINK: unset/1, force, 0 (WorkerConfig.link)


class LinkHost(Protocol):
    """What a link needs of the worker (expertmesh/worker/core.py): the device link's step
    graphs (``request`` mapped on our GPU), or with ``answer`` the host link's C thread (both
    areas in the coordinator's segment, cpu_expert_server/hostlink.py)."""

    def open_link(
        self,
        request: torch.Tensor,
        rows: int,
        top_k: int,
        answer: torch.Tensor | None = None,
        hidden: int | None = None,
        dtype: torch.dtype | None = None,
        relayed: bool = False,
    ) -> Any: ...

    def link_step(self, graphs: Any, step: dsc.LinkStep) -> None: ...

    def close_link(self, graphs: Any) -> None: ...

    def cancel_link(self, graphs: Any) -> None: ...


def link_refusal(mode: str, same_gpu: bool, host: bool) -> str:
    """Why this server takes no device link ("" = it may). ``same_gpu``: the coordinator
    computes on our GPU; ``host``: the worker can build step graphs at all."""
    if mode == "off":
        return "the device link is off on this server (EXPERTMESH_LINK=0)"
    if not host:
        return "this server has no step graphs for the device link"
    if same_gpu and mode != "force":
        return (
            "the coordinator computes on this server's GPU: two processes' spinning kernels would "
            "time-slice it (EXPERTMESH_LINK=force links anyway)"
        )
    return ""


class ShmServer:
    def __init__(
        self,
        hello: Hello,
        device: torch.device,
        forward: Callable[[ExpertRequest], torch.Tensor],  # [T, H] on device; raises ExpertMeshError
        on_error: Callable[[], None] = lambda: None,
        spin_us: float = 300.0,  # how long to poll for the next request before sleeping
        # check + compute writing the answer straight into the ring (ExpertWorker.forward_into)
        forward_into: Callable[[ExpertRequest, torch.Tensor], None] | None = None,
        link: LinkHost | None = None,  # the device link's step graphs (the worker); None: no link
        link_mode: str = "auto",  # LINK_MODES
    ) -> None:
        assert link_mode in LINK_MODES, f"{link_mode=}"
        self.hello, self.forward, self.on_error = hello, forward, on_error
        self.forward_into = forward_into
        self.link_host, self.link_mode = link, link_mode
        self._link: Any = None  # the link's step graphs (LinkHost.open_link), once accepted
        self._link_reason = "the coordinator offered no device link"
        self.device = cuda_ipc.indexed(device)
        self.spin_us = spin_us
        self.ack: Future[Ack] = Future()
        self._state = threading.Lock()  # guards the FIFOs against close() from the event loop
        self._stop = False
        self._fds: tuple[int, int] | None = None
        self._gpu_bytes = 0
        self._pinned = False  # the host ring is registered with CUDA (register_host)
        # per request (the last 4096): seconds of decode (the ready wait included), the ready
        # wait alone, forward (checks + compute launched), answer (GPU event); medians logged
        # when the channel closes (what a remote layer's server side costs)
        self.times: deque[tuple[float, float, float, float]] = deque(maxlen=4096)
        self._ready_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="expert-fast-path")

    def start(self) -> Future[Ack]:
        self._thread.start()
        return self.ack

    def close(self) -> None:
        """Stops the thread (any thread may call this, any number of times)."""
        with self._state:
            self._stop = True
            if self._fds is not None:
                os.write(self._fds[0], dsc.KICK)
        if self._link is not None and self.link_host is not None:
            self.link_host.cancel_link(self._link)  # a step in flight stops waiting for the coordinator

    # ------------------------------------------------------------ set-up

    def _attach(self) -> Ack:
        h = self.hello
        try:
            self._mm = segment.attach(h.segment, h.size)
            fds = segment.open_fifos(h.segment)
        except OSError as e:
            return Ack(
                "grpc",
                f"cannot open the coordinator's shared-memory segment {h.segment}: {e.strerror or e} "
                "(no /dev/shm shared with it?)",
            )
        finally:
            segment.unlink(h.segment)  # both sides have it mapped (or never will): drop the name
        with self._state:
            self._fds = fds
        magic, token, off, n = HEADER.unpack_from(self._mm, 0)
        if (magic, token.hex(), off, n) != (SEGMENT_MAGIC, h.token, h.ring_offset, h.ring_bytes):
            return Ack(
                "grpc", f"segment {h.segment} does not hold the coordinator's token (another /dev/shm?)"
            )
        self._host = Views(
            torch.frombuffer(self._mm, dtype=torch.uint8, offset=h.ring_offset, count=h.ring_bytes)
        )
        if h.cuda is None:
            # payloads cross between the host ring and our GPU: DMA once the ring is pinned
            self._pinned = cuda_ipc.register_host(self._host.ring, self.device)
            if h.host_link is not None:
                return Ack("shm", host_link=self._open_host_link(h.host_link))
            return Ack("shm")
        try:
            if self.device.type != "cuda":
                raise cuda_ipc.CudaIpcError("this server computes on the CPU")
            ours = device_uuid(self.device)
            if h.cuda.device_uuid != ours:  # two GPUs of this host: peer access or nothing
                theirs = cuda_ipc.device_of(h.cuda.device_uuid)
                if theirs is None or not torch.cuda.can_device_access_peer(self.device.index, theirs):
                    raise cuda_ipc.CudaIpcError(
                        f"the coordinator's GPU {h.cuda.device_uuid} is not ours ({ours}) and we "
                        "have no peer access to it"
                    )
                if h.cuda.sync != "local":
                    raise cuda_ipc.CudaIpcError("two GPUs order their work with sync 'local' only")
            self._in_map = cuda_ipc.Mapped.open(h.cuda.in_ring, self.device)
            self._in = Views(self._in_map.tensor)
            if h.cuda.sync != "local":
                self._ready = cuda_ipc.open_event(h.cuda.ready_event, self.device)
            self._out = Views(torch.empty(self._in.ring.numel(), dtype=torch.uint8, device=self.device))
            self._done, done = cuda_ipc.new_event(self.device)
        except cuda_ipc.CudaIpcError as e:
            return Ack("shm", f"CUDA IPC refused: {e}")
        self._gpu_bytes = self._out.ring.numel()
        cuda = {"out_ring": cuda_ipc.share(self._out.ring), "done_event": done}
        if h.cuda.link is not None:
            cuda.update(self._open_link(h.cuda.link, same_gpu=h.cuda.device_uuid == ours))
        return Ack("cuda_ipc", cuda=cuda)

    def _open_link(self, offer: dict, same_gpu: bool) -> dict:
        """``{"link_area": ...}`` (accepted) or ``{"link_reason": why}``; the offer's shape was
        checked by Hello.decode."""
        why = link_refusal(self.link_mode, same_gpu, self.link_host is not None)
        if not why:
            assert self.link_host is not None
            try:
                self._link_map = cuda_ipc.Mapped.open(offer["area"], self.device)
                self._link = self.link_host.open_link(self._link_map.tensor, offer["rows"], offer["top_k"])
                area = cuda_ipc.share(self._link.answer)
            # NOTE: RuntimeError: torch's CUDA errors (out of memory): the link only is refused
            except (cuda_ipc.CudaIpcError, errors.ExpertMeshError, RuntimeError) as e:
                why = f"the device link could not be set up: {e}"
                self._drop_link()
        if why:
            self._link_reason = why
            log.info("fast-path channel %s: no device link: %s", self.hello.segment, why)
            return {"link_reason": why}
        log.info(
            "fast-path channel %s: device link accepted (%d rows, top-k %d)",
            self.hello.segment,
            offer["rows"],
            offer["top_k"],
        )
        return {"link_area": area}

    def _open_host_link(self, offer: dict) -> dict:
        """``{"accepted": True}`` or ``{"reason": why}`` for a host link offer (its shape and
        its place in the segment were checked by Hello.decode)."""
        why = "the link is off on this server (EXPERTMESH_LINK=0)" if self.link_mode == "off" else ""
        if not why and self.link_host is None:
            why = "this server serves no link"
        if not why:
            assert self.link_host is not None
            rows, hidden, top_k, dtype = (
                offer["rows"],
                offer["hidden"],
                offer["top_k"],
                wire.DTYPES[offer["dtype"]],
            )
            req_off, ans_off, end = host_areas(offer["offset"], rows, hidden, top_k, dtype)
            req = torch.frombuffer(self._mm, dtype=torch.uint8, offset=req_off, count=ans_off - req_off)
            ans = torch.frombuffer(self._mm, dtype=torch.uint8, offset=ans_off, count=end - ans_off)
            try:
                self._link = self.link_host.open_link(
                    req, rows, top_k, answer=ans, hidden=hidden, dtype=dtype
                )
            # NOTE: RuntimeError: torch's (an allocation): the link only is refused, not the channel
            except (errors.ExpertMeshError, RuntimeError) as e:
                why = f"the host link could not be set up: {e.message if isinstance(e, errors.ExpertMeshError) else e}"
        if why:
            self._link_reason = why
            log.info("fast-path channel %s: no host link: %s", self.hello.segment, why)
            return {"reason": why}
        log.info(
            "fast-path channel %s: host link accepted (%d rows, top-k %d)", self.hello.segment, rows, top_k
        )
        return {"accepted": True}

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            ack = self._attach()
        except Exception as e:  # noqa: BLE001  # NOTE: a thread's boundary: the handshake must get an answer
            log.exception("fast-path set-up failed")
            ack = Ack("grpc", f"fast-path set-up failed: {type(e).__name__}: {e}")
        self.ack.set_result(ack)
        try:
            if ack.transport != "grpc":
                self._serve()
        finally:
            self._release()

    # ------------------------------------------------------------ serving

    def _serve(self) -> None:
        assert self._fds is not None
        req_fd, resp_fd = self._fds
        host_bytes = self.hello.ring_bytes
        words = header_words(self._mm)
        spin = Spin(self.spin_us)
        seen = answered = 0  # descriptors read / written, mod 2**32

        def arrived() -> bool:
            return words[REQUESTS_WORD] != seen or self._stop

        while not self._stop:
            if spin.until(arrived):
                raw = os.read(req_fd, dsc.SIZE)
            else:
                t0 = time.monotonic()
                raw = os.read(req_fd, dsc.SIZE)
                spin.blocked_for(time.monotonic() - t0)
            if self._stop or dsc.is_kick(raw):
                return
            seen = (seen + 1) & 0xFFFFFFFF
            seq = 0
            t0 = time.perf_counter()
            refused = False  # a link step refused: the channel goes on
            try:
                if dsc.is_link_step(raw):
                    step = dsc.LinkStep.parse(raw)
                    seq = step.seq
                    resp = self._link_step(step, t0)
                    refused = resp.code != 0
                else:
                    req = dsc.Request.parse(raw, host_bytes, self._gpu_bytes)
                    seq = req.seq
                    self._one(req, t0)
                    resp = dsc.Response(seq, 0, (time.perf_counter() - t0) * 1e3)
            except dsc.DescriptorError as e:
                self.on_error()
                resp = self._error(seq, errors.InvalidRequest(f"invalid fast-path descriptor: {e}"))
            except errors.ExpertMeshError as e:
                resp = self._error(seq, e)
            except Exception as e:  # noqa: BLE001  # NOTE: a thread's boundary: the coordinator must get an answer
                log.exception("fast-path request %d failed", seq)
                self.on_error()
                resp = self._error(seq, errors.Internal(f"{type(e).__name__}: {e}"))
            os.write(resp_fd, resp.pack())
            answered = (answered + 1) & 0xFFFFFFFF
            words[RESPONSES_WORD] = answered
            if resp.code and not refused:
                return  # a bad request ends the channel, as it ends a gRPC stream

    def _link_step(self, step: dsc.LinkStep, t0: float) -> dsc.Response:
        """Launches a linked step's graph; a refusal is answered, never raised."""
        if self._link is None:
            err: errors.ExpertMeshError = errors.Incompatible(
                f"no device link on this channel: {self._link_reason}"
            )
            return self._error(step.seq, err)
        assert self.link_host is not None
        try:
            self.link_host.link_step(self._link, step)
        except errors.ExpertMeshError as e:
            return self._error(step.seq, e)
        return dsc.Response(step.seq, 0, (time.perf_counter() - t0) * 1e3)

    def _drop_link(self) -> None:
        """After the link's last step graph (bounded: its waits time out), the request area
        is unmapped (cuda_ipc's close synchronises the device first)."""
        graphs, self._link = self._link, None
        if graphs is not None:
            assert self.link_host is not None
            self.link_host.close_link(graphs)
        mapped = self.__dict__.pop("_link_map", None)
        if mapped is not None:
            try:
                mapped.close()
            except cuda_ipc.CudaIpcError:
                log.exception("could not unmap the device link's request area")

    @staticmethod
    def _error(seq: int, err: errors.ExpertMeshError) -> dsc.Response:
        return dsc.Response(seq, err.status, 0.0, err.message)

    def _one(self, req: dsc.Request, t0: float) -> None:
        clock = time.perf_counter
        self._ready_s = 0.0
        out_ring = self._out if req.on_gpu else self._host
        out = out_ring.tensor(req.out_off, (req.tokens, req.hidden), req.out_dtype)
        decoded = self._decode(req)
        t1 = clock()
        if self.forward_into is not None:
            # NOTE: a host ``out`` is written synchronously: the answer is there before its descriptor
            self.forward_into(decoded, out)
        else:
            out.copy_(self.forward(decoded))
        t2 = clock()
        if req.on_gpu:
            assert self.hello.cuda is not None
            if self.hello.cuda.sync == "local":
                torch.cuda.current_stream(self.device).synchronize()
            else:
                self._done.record()  # NOTE: this thread's current stream of our device
        self.times.append((t1 - t0, self._ready_s, t2 - t1, clock() - t2))

    def _decode(self, req: dsc.Request) -> ExpertRequest:
        """This path's codec: a descriptor and the ring contents -> the one request type."""
        t, h, k = req.tokens, req.hidden, req.top_k
        data = self._in if req.on_gpu else self._host
        hidden = data.tensor(req.hidden_off, (t, h), req.hidden_dtype)  # read, never written
        # NOTE: our own copy of the routing block: what was validated is what gets computed,
        # whatever the other side writes meanwhile (uploaded by the server's graph from a pinned
        # block of its own, or synchronously from this pageable copy)
        mine = self._host.block(req.route_off, t, k).copy()  # [2, T, K]
        slot_ids, weights = torch.from_numpy(mine[0]), torch.from_numpy(mine[1].view(np.float32))
        if req.on_gpu:
            assert self.hello.cuda is not None
            if self.hello.cuda.sync == "host":
                t0 = time.perf_counter()
                self._ready.synchronize()
                self._ready_s = time.perf_counter() - t0
            elif self.hello.cuda.sync == "stream":
                torch.cuda.current_stream(self.device).wait_event(self._ready)
            # "local": the coordinator finished writing before it sent the descriptor
        adapters = None
        if req.has_adapters:
            adapters = torch.from_numpy(self._host.adapters(req.route_off, t, k).copy())  # [T] int32
        return ExpertRequest(req.seq, req.generation, req.layer, hidden, slot_ids, weights, adapters)

    def _release(self) -> None:
        if self.times:
            decode, ready, forward, answer = (f"{statistics.median(c) * 1e6:.0f}" for c in zip(*self.times))
            # NOTE: only a CUDA channel synchronised on the host waits for the coordinator's GPU
            host_sync = self.hello.cuda is not None and self.hello.cuda.sync == "host"
            waited = f" (waiting for the coordinator's GPU {ready})" if host_sync else ""
            log.info(
                "fast-path channel %s closed: median us of its last %d requests: decode %s%s, forward %s, "
                "answer %s",
                self.hello.segment,
                len(self.times),
                decode,
                waited,
                forward,
                answer,
            )
        with self._state:
            self._stop = True
            fds, self._fds = self._fds, None
        if fds is not None:
            for fd in fds:
                os.close(fd)
        self._drop_link()
        if self._pinned:
            self._pinned = False
            try:
                cuda_ipc.unregister_host(self._host.ring, self.device)
            except cuda_ipc.CudaIpcError:
                log.exception("could not unpin the fast-path ring")
        for name in ("_in", "_out", "_host"):
            views = self.__dict__.pop(name, None)
            if views is not None:
                views.clear()
        if hasattr(self, "_in_map"):
            self._in_map.close()
        mm = self.__dict__.pop("_mm", None)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view is still referenced: it goes with that
                mm.close()
