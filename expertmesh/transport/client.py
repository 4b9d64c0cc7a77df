"""The coordinator's end of a fast-path channel to one expert server (one per ``Forward`` stream).

Per request: allocate room in the ring (payload + answer), write the hidden states and the
routing block there, write a :data:`~expertmesh.transport.descriptor.SIZE`-byte descriptor
into the request FIFO; the server answers with a response descriptor in the response FIFO and
the output in the room reserved for it. With ``cuda_ipc`` the hidden states go to this side's
GPU ring and the output comes back in the server's GPU ring, ordered by two interprocess
events; only the routing block and the descriptors touch host memory.

A link (expertmesh/transport/link.py) is offered with ``link=(R, H, K, dtype)``: over
``cuda_ipc`` the device link (a request area on our GPU), over ``shm`` the host link (the
request and answer areas appended to the segment, each on its own pages: a CPU server's C
thread polls ours and writes its own). :attr:`ShmClient.link` is live once the server took it.

Threads: ``send`` and ``Reply.result`` run on the caller's thread (the scheduler's); ``kill``
may come from any thread (the gRPC reader that saw the stream die) and wakes a waiter through
the response FIFO, which this side also holds open for writing.

Shapes: T tokens sent to this server, H hidden, K top-k.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from expertmesh import errors, wire
from expertmesh.net import device_uuid
from expertmesh.transport import cuda_ipc, segment
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import link_layout as ll
from expertmesh.transport.errors import MalformedAnswer, Rejected
from expertmesh.transport.handshake import Ack, CudaHello, Hello
from expertmesh.transport.layout import (
    HEADER,
    HEADER_BYTES,
    REQUESTS_WORD,
    RESPONSES_WORD,
    SEGMENT_MAGIC,
    Views,
    aligned,
    header_words,
)
from expertmesh.transport.ring import Region, Ring
from expertmesh.transport.spin import Spin
from expertmesh.worker_api import ExpertRequest

if TYPE_CHECKING:
    from expertmesh.transport import link as lk


@dataclass
class Reply:
    """One request in flight on the fast path."""

    channel: ShmClient
    seq: int
    out: torch.Tensor  # [T, H] where the server writes the answer
    regions: tuple[tuple[Ring, Region], ...]  # where the request and its answer sit
    server_ms: float = 0.0  # the server's time from reading the descriptor to answering

    def result(self, timeout: float) -> torch.Tensor:
        """The output ``[T, H]`` (a view into the ring: use it before :meth:`release`).

        Raises FutureTimeout after ``timeout`` seconds, Rejected if the server refused the
        request or the channel died."""
        self.server_ms = self.channel.wait(self.seq, time.monotonic() + timeout).compute_ms
        if self.channel.gpu:
            self.channel.wait_done()
        return self.out

    def release(self) -> None:
        """Gives the ring space back (after the output was read)."""
        for ring, region in self.regions:
            if not region.freed:
                ring.free(region)

    def abandon(self) -> None:
        """Nobody will read the output: the space comes back once the answer has arrived."""
        self.channel.abandon(self)


@dataclass
class _Staged:
    """Hidden states copied into the ring ahead of their request (ShmClient.stage)."""

    ptr: int  # data_ptr of the source [T, H]
    shape: tuple[int, int]
    dtype: torch.dtype
    top_k: int
    region: tuple[Ring, Region]  # the GPU ring's payload, or the host ring's whole request


@dataclass
class LinkAreas:
    """The coordinator's end of a device link (expertmesh/transport/link.py) on this channel:
    its request area (ours, written by our decode graph) and the server's answer area (mapped).
    A captured graph holds their addresses: ``lock`` is held around a linked replay, and
    :meth:`ShmClient.close` takes it before it unmaps the answer area."""

    rows: int  # R: the largest bucket a linked step may use
    hidden: int
    top_k: int
    dtype: torch.dtype  # the server's compute dtype (the areas' payload dtype)
    req: lk.RequestViews
    area: torch.Tensor  # [request_bytes] uint8, ours
    ans: lk.AnswerViews | None = None  # None until the server accepted the link
    # what maps the areas on our GPU, closed with the channel before its memory goes: the
    # server's answer area (device link: cuda_ipc.Mapped), or both areas' pinned and mapped
    # pages (host link: host_map.HostMapped, set by the coordinator's linked graphs)
    mapped: Any = None
    # NOTE: reentrant: a linked step that resets its own stream (close()) holds it already
    lock: threading.RLock = field(default_factory=threading.RLock)
    closed: bool = False
    next_step: int = 1  # step numbers never repeat on a link (flag 0 = nothing yet)
    # ends the waits of step N at once (link.Canceller over the linked graphs' abort word, set
    # by coordinator/model/remote_graphs.py): called when this channel dies, so that a step in
    # flight does not spin until its timeout
    cancel: Callable[[int], None] | None = None
    # a host link: both areas are CPU tensors over this channel's shared-memory segment (the
    # request area ours to write, the answer area the CPU server's); False: the device link
    host: bool = False
    # a host link's answer area (whole pages, like ``area``), once the server took the link
    answer: torch.Tensor | None = None
    # the most micro-batches a linked step may carry (a relayed link whose server takes them:
    # each micro-batch in its own rows of the areas, expertmesh/transport/relay.c); 1: none
    micro: int = 1


class ShmClient:
    def __init__(
        self,
        transport: str,
        ring_bytes: int,
        device: torch.device,
        spin_us: float = 300.0,
        cuda_sync: str = "host",  # how the two sides order their GPU work (cuda_ipc.SYNC_MODES)
        link: tuple[int, int, int, torch.dtype] | None = None,  # offer a device link: (R, H, K, dtype)
    ) -> None:
        assert transport in ("shm", "cuda_ipc"), f"{transport=}"
        self.transport, self.device = transport, cuda_ipc.indexed(device)
        self.gpu = transport == "cuda_ipc"
        segment.sweep()
        self.name = segment.new_name()
        size = HEADER_BYTES + ring_bytes
        host_link = None  # (request offset, answer offset, end) of a host link's areas
        if transport == "shm" and link is not None:
            host_link = ll.host_areas(size, link[0], link[1], link[2], link[3])
            size = host_link[2]
        self._mm = segment.create(self.name, size)
        try:
            self._req_fd, self._resp_fd = segment.open_fifos(self.name)
        except OSError:
            self._mm.close()
            segment.unlink(self.name)
            raise
        self._token = secrets.token_bytes(16)
        HEADER.pack_into(self._mm, 0, SEGMENT_MAGIC, self._token, HEADER_BYTES, ring_bytes)
        self._host = Views(
            torch.frombuffer(self._mm, dtype=torch.uint8, offset=HEADER_BYTES, count=ring_bytes)
        )
        self._ring = Ring(ring_bytes)
        self._size, self._ring_bytes = size, ring_bytes
        # shm from a GPU: hidden states and answers cross between the ring and our GPU by DMA
        # once the ring is pinned (cuda_ipc only puts the routing block there)
        self._pinned = not self.gpu and cuda_ipc.register_host(self._host.ring, self.device)
        self._poll = select.poll()
        self._poll.register(self._resp_fd, select.POLLIN)
        self._words = header_words(self._mm)
        self._sent = self._received = 0  # request / response descriptors, mod 2**32
        self._spin = Spin(spin_us)
        self._answers: dict[int, dsc.Response] = {}  # arrived before their waiter asked
        self._orphans: dict[int, Reply] = {}  # abandoned: freed when their answer arrives
        self._inflight: set[int] = set()  # seqs posted and not answered yet
        self._lock = threading.Lock()  # held by a waiter while it reads the response FIFO
        self._state = threading.Lock()  # guards _dead/_closed against kill() from other threads
        self._dead: Rejected | None = None
        self._closed = False
        self._staged: _Staged | None = None  # hidden states copied ahead of their send (stage())
        self._cuda: CudaHello | None = None
        # the device link offered in the Hello (None: not offered), live once accepted
        self._link: LinkAreas | None = None
        self.link_reason = "not offered"  # why there is no live link
        self._link_seqs: set[int] = set()  # link steps awaiting their answer: a refusal is no failure
        self._host_offer: dict | None = None
        if host_link is not None:
            assert link is not None
            self._offer_host_link(host_link, *link)
        if self.gpu:
            self._in_ring = Views(torch.empty(ring_bytes, dtype=torch.uint8, device=device))
            self._gpu_ring = Ring(ring_bytes)
            self.ready_event, ready = cuda_ipc.new_event(device)
            offer = None
            if link is not None:
                from expertmesh.transport import link as lk  # NOTE: Triton, only where a link is offered

                rows, hidden, top_k, dtype = link
                area = lk.new_area(lk.request_bytes(rows, hidden, top_k, dtype), self.device)
                req = lk.RequestViews.of(area, rows, hidden, top_k, dtype)
                self._link = LinkAreas(rows, hidden, top_k, dtype, req, area)
                offer = {"area": cuda_ipc.share(area), "rows": rows, "top_k": top_k}
            self._cuda = CudaHello(
                device_uuid(self.device), cuda_ipc.share(self._in_ring.ring), ready, cuda_sync, offer
            )

    def _offer_host_link(
        self, where: tuple[int, int, int], rows: int, hidden: int, top_k: int, dtype: torch.dtype
    ) -> None:
        """The host link's areas after the ring (zeroed by the segment's creation) and its offer."""
        req_off, ans_off, end = where
        area = torch.frombuffer(self._mm, dtype=torch.uint8, offset=req_off, count=ans_off - req_off)
        req = ll.RequestViews.of(area, rows, hidden, top_k, dtype)
        self._link = LinkAreas(rows, hidden, top_k, dtype, req, area, host=True)
        self._host_answer = torch.frombuffer(self._mm, dtype=torch.uint8, offset=ans_off, count=end - ans_off)
        self._host_offer = {
            "offset": req_off,
            "rows": rows,
            "hidden": hidden,
            "top_k": top_k,
            "dtype": wire.dtype_name(dtype),
        }

    # ------------------------------------------------------------ handshake

    def hello(self) -> bytes:
        return Hello(
            self.transport,
            self.name,
            self._size,
            HEADER_BYTES,
            self._ring_bytes,
            self._token.hex(),
            self._cuda,
            self._host_offer,
        ).encode()

    def accept(self, ack: Ack) -> None:
        """The server mapped the segment (and, with cuda_ipc, shared its output ring)."""
        segment.unlink(self.name)
        if self.gpu and ack.transport == "cuda_ipc":
            self._out_map = cuda_ipc.Mapped.open(ack.cuda["out_ring"], self.device)
            self._out_ring = Views(self._out_map.tensor)
            assert self._cuda is not None
            if self._cuda.sync != "local":  # NOTE: "local" (two GPUs) shares no event
                self.done_event = cuda_ipc.open_event(ack.cuda["done_event"], self.device)
            self._accept_link(ack)
        elif self.gpu:  # the server could serve shm only
            self.gpu, self.transport = False, "shm"
            del self._in_ring, self._gpu_ring, self.ready_event
            self._pinned = cuda_ipc.register_host(self._host.ring, self.device)
        elif self._host_offer is not None and ack.transport == "shm":
            self._accept_host_link(ack)
        if self._link is not None and self._link.ans is None:
            self._link = None  # the request area goes
        assert ack.transport == self.transport, f"{ack.transport=} {self.transport=}"

    def _accept_link(self, ack: Ack) -> None:
        """Maps the server's answer area when it accepted our link offer."""
        lnk = self._link
        if lnk is None:
            return
        from expertmesh.transport import link as lk

        info = ack.cuda.get("link_area")
        if info is None:
            self.link_reason = str(ack.cuda.get("link_reason") or "the server did not take the link")
            return
        try:
            mapped = cuda_ipc.Mapped.open(info, self.device)
        except cuda_ipc.CudaIpcError as e:
            self.link_reason = f"cannot map the server's link answer area: {e}"
            return
        need = lk.answer_bytes(lnk.rows, lnk.hidden, lnk.dtype)
        if mapped.tensor.numel() < need:
            mapped.close()
            self.link_reason = f"the server's link answer area holds {info.get('nbytes')} bytes, need {need}"
            return
        try:  # NOTE: loads the flag kernels now, while nothing spins (link.py's NOTE on lazy loading)
            lk.warm_up(self.device)
        except RuntimeError as e:  # Triton could not build or load them here
            mapped.close()
            self.link_reason = f"the link's flag kernels do not run here: {e}"
            return
        lnk.ans, lnk.mapped = lk.AnswerViews.of(mapped.tensor, lnk.rows, lnk.hidden, lnk.dtype), mapped
        self.link_reason = ""

    def _accept_host_link(self, ack: Ack) -> None:
        lnk = self._link
        assert lnk is not None and lnk.host
        if ack.host_link.get("accepted") is True:
            lnk.ans = ll.AnswerViews.of(self._host_answer, lnk.rows, lnk.hidden, lnk.dtype)
            lnk.answer = self._host_answer
            self.link_reason = ""
        else:
            self.link_reason = str(ack.host_link.get("reason") or "the server did not take the host link")

    @property
    def link(self) -> LinkAreas | None:
        """The live device link of this channel (None: none, or the channel died)."""
        lnk = self._link
        return lnk if lnk is not None and lnk.ans is not None and self._dead is None else None

    # ------------------------------------------------------------ data path

    def stage(self, x: torch.Tensor, dtype: torch.dtype, top_k: int) -> bool:
        """Queues the copy of ``x [T, H]`` (on our GPU) into the ring on the current stream now,
        for the next :meth:`send` of every row of this same ``x`` (no adapters): that send then
        launches nothing on the GPU. The piecewise decode graphs call this right after a
        segment's replay, so the copy's launch overlaps the segment's GPU work and the host's
        wait for the routing covers it (coordinator/model/remote_graphs.py). False when there is no
        room or nothing to gain (a send not matching it copies as usual)."""
        self._unstage()
        if x.device.type != "cuda" or not (self.gpu or self._pinned):
            return False
        t, h = x.shape
        payload = t * h * dtype.itemsize
        if self.gpu:
            gpu_r = self._gpu_ring.alloc(payload)
            if gpu_r is None:
                return False
            self._in_ring.tensor(gpu_r.offset, (t, h), dtype).copy_(x)
            if self._cuda is not None and self._cuda.sync != "local":
                self.ready_event.record(torch.cuda.current_stream(self.device))
            self._staged = _Staged(x.data_ptr(), (t, h), dtype, top_k, (self._gpu_ring, gpu_r))
            return True
        n_h, n_r = aligned(payload), aligned(dsc.route_nbytes(t, top_k))
        host_r = self._ring.alloc(n_h + n_r + payload)
        if host_r is None:
            return False
        # NOTE: a DMA into the pinned ring, finished before the caller's next synchronisation
        self._host.tensor(host_r.offset, (t, h), dtype).copy_(x, non_blocking=True)
        self._staged = _Staged(x.data_ptr(), (t, h), dtype, top_k, (self._ring, host_r))
        return True

    def _unstage(self) -> None:
        st, self._staged = self._staged, None
        if st is not None:  # never sent: its copy may still be queued
            torch.cuda.current_stream(self.device).synchronize()
            st.region[0].free(st.region[1])

    def _take_staged(self, req: ExpertRequest, dtype: torch.dtype) -> _Staged | None:
        st = self._staged
        if st is None:
            return None
        x, k = req.hidden, req.slot_ids.shape[1]
        if (
            x.data_ptr() == st.ptr
            and tuple(x.shape) == st.shape
            and dtype == st.dtype
            and k == st.top_k
            and req.adapter_slots is None
            and (req.rows is None or req.rows.numel() == x.shape[0])
        ):
            self._staged = None
            return st
        self._unstage()
        return None

    def send(self, req: ExpertRequest, dtype: torch.dtype) -> Reply | None:
        """This path's codec: queues ``req`` (hidden cast to the server's compute ``dtype``);
        None when the ring has no room for it (send it over gRPC)."""
        x, rows, slot_ids = req.hidden, req.rows, req.slot_ids
        t, k = slot_ids.shape
        h = x.shape[1]
        payload = t * h * dtype.itemsize
        adapters = req.adapter_slots
        route = dsc.route_nbytes(t, k, adapters is not None)
        regions: tuple[tuple[Ring, Region], ...]
        staged = self._take_staged(req, dtype) if self._staged is not None else None
        if staged is not None:  # the hidden states are (being) copied already
            ring, region = staged.region
            if not self.gpu or (self._cuda is not None and self._cuda.sync == "local"):
                # NOTE: in the ring before the descriptor (the caller has usually waited already)
                torch.cuda.current_stream(self.device).synchronize()
            if self.gpu:
                host_r = self._ring.alloc(route)
                if host_r is None:
                    ring.free(region)
                    return None
                regions = ((self._ring, host_r), (ring, region))
                h_off = o_off = region.offset
                r_off = host_r.offset
                out = self._out_ring.tensor(o_off, (t, h), dtype)
            else:
                regions = ((ring, region),)
                n_h = aligned(payload)
                h_off, r_off, o_off = region.offset, region.offset + n_h, region.offset + n_h + aligned(route)
                out = self._host.tensor(o_off, (t, h), dtype)
            return self._post(req, dtype, regions, out, h_off, r_off, o_off)
        if self.gpu:  # hidden [T, H] at the same offset of both GPU rings, routing on the host
            host_r = self._ring.alloc(route)
            if host_r is None:
                return None
            gpu_r = self._gpu_ring.alloc(payload)
            if gpu_r is None:
                self._ring.free(host_r)
                return None
            regions = ((self._ring, host_r), (self._gpu_ring, gpu_r))
            h_off = o_off = gpu_r.offset
            r_off = host_r.offset
            hidden = self._in_ring.tensor(h_off, (t, h), dtype)
            out = self._out_ring.tensor(o_off, (t, h), dtype)
        else:  # [hidden | routing block | output] in one host region
            n_h, n_r = aligned(payload), aligned(route)
            host_r = self._ring.alloc(n_h + n_r + payload)
            if host_r is None:
                return None
            regions = ((self._ring, host_r),)
            h_off, r_off, o_off = host_r.offset, host_r.offset + n_h, host_r.offset + n_h + n_r
            hidden = self._host.tensor(h_off, (t, h), dtype)
            out = self._host.tensor(o_off, (t, h), dtype)
        if rows is None or t == x.shape[0]:  # every row of the step (rows are sorted and unique)
            hidden.copy_(x)
        elif x.device == hidden.device and x.dtype == dtype:
            torch.index_select(x, 0, rows if x.device.type == "cpu" else rows.to(x.device), out=hidden)
        else:
            hidden.copy_(x.index_select(0, rows.to(x.device)))
        if self.gpu:
            if self._cuda is not None and self._cuda.sync == "local":
                torch.cuda.current_stream(self.device).synchronize()
            else:
                self.ready_event.record(torch.cuda.current_stream(self.device))
        return self._post(req, dtype, regions, out, h_off, r_off, o_off)

    def _post(
        self,
        req: ExpertRequest,
        dtype: torch.dtype,
        regions: tuple[tuple[Ring, Region], ...],
        out: torch.Tensor,
        h_off: int,
        r_off: int,
        o_off: int,
    ) -> Reply:
        """Writes the routing block and the descriptor of a request whose hidden states are in
        the ring (or on their way there, ordered before the server reads them)."""
        slot_ids, weights, adapters = req.slot_ids, req.weights, req.adapter_slots
        t, k = slot_ids.shape
        h = req.hidden.shape[1]
        block = self._host.block(r_off, t, k)  # [2, T, K]
        block[0] = slot_ids.numpy()
        block[1] = weights.numpy().view(np.int32)
        if adapters is not None:
            self._host.adapters(r_off, t, k)[:] = adapters.numpy()
        flags = (dsc.FLAG_GPU if self.gpu else 0) | (dsc.FLAG_ADAPTERS if adapters is not None else 0)
        desc = dsc.Request(
            req.seq, req.generation, req.layer, t, h, k, dtype, dtype, h_off, r_off, o_off, flags
        )
        self._inflight.add(req.seq)  # before the descriptor: the answer may follow at once
        os.write(self._req_fd, desc.pack())
        self._sent = (self._sent + 1) & 0xFFFFFFFF
        self._words[REQUESTS_WORD] = self._sent  # after the write: a spinning server may read it now
        return Reply(self, req.seq, out, regions)

    def link_step(self, step: dsc.LinkStep, deadline: float) -> dsc.Response:
        """Sends a device-link step and waits for its answer (code 0: the server's
        step graph is launched; anything else: refused for this step, the channel lives on).
        Raises FutureTimeout past ``deadline``, Rejected if the channel died."""
        self.send_link_step(step)
        return self.link_answer(step.seq, deadline)

    def send_link_step(self, step: dsc.LinkStep) -> None:
        """Sends a device-link step without waiting: its answer is read by :meth:`link_answer`
        (meanwhile the coordinator launches its own side of the step). Raises Rejected if the
        channel died."""
        if self._dead is not None:
            raise self._dead
        self._inflight.add(step.seq)
        self._link_seqs.add(step.seq)  # until its answer is read: a refusal is no failure
        try:
            os.write(self._req_fd, step.pack())
        except OSError:
            self._inflight.discard(step.seq)
            self._link_seqs.discard(step.seq)
            raise
        self._sent = (self._sent + 1) & 0xFFFFFFFF
        self._words[REQUESTS_WORD] = self._sent

    def link_answer(self, seq: int, deadline: float) -> dsc.Response:
        """The answer to the link step ``seq`` sent by :meth:`send_link_step` (as :meth:`link_step`)."""
        try:
            return self.wait(seq, deadline)
        finally:
            self._link_seqs.discard(seq)

    def _answered(self) -> bool:
        return self._words[RESPONSES_WORD] != self._received or self._dead is not None

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
                    # NOTE: an answer that already arrived is read before giving
                    # up: a layer's later servers are collected with the deadline an earlier,
                    # hung one used up, and a healthy server must not be marked down for it
                    if not self._poll.poll(0):
                        raise FutureTimeout()
                elif not self._spin.until(self._answered):
                    t0 = time.monotonic()
                    if not self._poll.poll(max(1, int(left * 1e3))):
                        continue
                    self._spin.blocked_for(time.monotonic() - t0)
                elif not self._poll.poll(max(1, int(left * 1e3))):
                    # NOTE: the server counts an answer in shared memory before it
                    # writes the descriptor; stopped or killed in between, a bare read here
                    # blocked forever (a step hung past its expert timeout). Bounded instead.
                    continue
                raw = os.read(self._resp_fd, dsc.SIZE)
                if dsc.is_kick(raw):
                    continue
                self._received = (self._received + 1) & 0xFFFFFFFF
                try:
                    r = dsc.Response.parse(raw)
                except dsc.DescriptorError as e:
                    # a server fault (its rows fail over), not a refused request
                    self.kill(Rejected(MalformedAnswer(f"bad response descriptor: {e}")))
                    continue
                if (
                    r.code and r.seq not in self._link_seqs
                ):  # the server stops serving the channel after any error
                    self.kill(Rejected(errors.from_status(r.code, r.message)))
                    continue
                if r.seq not in self._inflight:  # would leave the real answer unread
                    self.kill(Rejected(MalformedAnswer(f"an answer for seq {r.seq}, which is not in flight")))
                    continue
                self._inflight.discard(r.seq)
                orphan = self._orphans.pop(r.seq, None)
                if orphan is not None:
                    self._retire(orphan)
                else:
                    self._answers[r.seq] = r

    def abandon(self, reply: Reply) -> None:
        with self._lock:
            if self._dead is not None:
                return  # nothing more arrives; the rings go with the channel
            if self._answers.pop(reply.seq, None) is not None:
                self._retire(reply)
            else:
                self._orphans[reply.seq] = reply

    def _retire(self, reply: Reply) -> None:
        if self.gpu:  # the server's reads of the hidden states come before their space is reused
            self.wait_done()
        reply.release()

    def wait_done(self) -> None:
        """Orders what follows after the server's GPU work of the answers read so far."""
        assert self._cuda is not None
        if self._cuda.sync == "host":
            self.done_event.synchronize()
        elif self._cuda.sync == "stream":
            torch.cuda.current_stream(self.device).wait_event(self.done_event)
        # "local": the server finished its GPU work before it answered

    # ------------------------------------------------------------ teardown

    def kill(self, err: Rejected) -> None:
        """Fails every present and future wait with ``err`` (any thread)."""
        with self._state:
            if self._dead is not None:
                return
            self._dead = err
            if not self._closed:
                os.write(self._resp_fd, dsc.KICK)
        lnk = self._link
        if lnk is not None and lnk.cancel is not None:
            lnk.cancel(lnk.next_step - 1)  # NOTE: the last step handed out: in flight, or done (no-op)

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def error(self) -> Rejected | None:
        """Why the channel died (None while it lives)."""
        return self._dead

    def close(self) -> None:
        self.kill(Rejected(errors.Cancelled("fast-path channel closed")))
        lnk = self._link
        # NOTE: the link's lock first (a linked step holds it, then this channel's lock while
        # it waits for its answer): a graph that may still read the answer area ends first
        with lnk.lock if lnk is not None else contextlib.nullcontext(), self._lock, self._state:
            if self._closed:
                return
            self._closed = True
            if lnk is not None:
                lnk.closed = True
                lnk.ans = lnk.answer = None
                if lnk.mapped is not None:
                    lnk.mapped.close()
            os.close(self._req_fd)
            os.close(self._resp_fd)
            segment.unlink(self.name)  # if the handshake never finished
            if self.gpu and hasattr(self, "_out_map"):
                self._out_ring.clear()
                del self._out_ring
                self._out_map.close()
            if self._pinned:
                self._pinned = False
                # NOTE: a refused unpin leaves the pages pinned until exit: nothing else to do
                with contextlib.suppress(cuda_ipc.CudaIpcError):
                    cuda_ipc.unregister_host(self._host.ring, self.device)
            self._host.clear()
            del self._host, self._words
            self.__dict__.pop("_host_answer", None)
            with contextlib.suppress(BufferError):  # a caller still holds a view: it goes with that
                self._mm.close()
