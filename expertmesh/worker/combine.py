"""Cross-stream batching on an expert server (opt-in, ``--combine-streams``): fast-path
requests of several streams for the same layer are computed together.

Several coordinators sharing a server each send one layer at a time; their requests for a
layer reach the server on their own channel threads and, without this, are computed one after
the other, each on few rows. Here each request is put on a list before its thread waits for
the worker's lock; the thread that gets the lock takes every request on the list that can share
its batch (same layer, generation, top-k, device and dtype, no MoE LoRA), checks each one (a bad
one fails alone, never its neighbours), computes them as one ``[sum T, H]`` request and copies
each answer into its own output; the threads whose requests it took find them done when they
get the lock.

Meeting (``--combine-wait-us W``): requests merge only if they wait at the same moment, and two
coordinators whose steps are not aligned rarely do. So a request for layer ``l`` may be held up
to W microseconds for the streams expected to send ``l`` next: other streams of the same kind
(every batch key part but the layer) that sent a request in the last ``ACTIVE_S`` and whose last
layer comes at most half the MoE layers before ``l`` (cyclically: the next step starts again at
the first layer). A stream whose last layer is ``l`` or after it is not waited for, so of two
streams only the one ahead waits. The hold ends as soon as every awaited stream's request has
come (or that stream moved past ``l``), when another thread computes the batch, or at its
deadline: W after it came, or sooner the awaited streams' usual gap between two of their
requests (one that has not sent its next layer by then has stalled: its step's end, a prefill).
Each hold shortens the gap between the two streams, and once a layer is computed for both they
get their answers at the same moment and send the next layer close together, so later layers
meet with little waiting. A lone stream never waits.

What it costs: a held stream is slowed by its holds (the one ahead keeps the pace of the one
behind); a request computed alone loses the early input copy of a graphed GPU backend
(``load_input``); requests naming adapters are never combined.

Shapes: T tokens of one request, H hidden, K top-k.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from expertmesh.errors import ExpertMeshError, Internal
from expertmesh.worker_api import ExpertRequest

# a stream that sent nothing for this long is not waited for (its coordinator is idle or gone)
ACTIVE_S = 1.0
GAP_WEIGHT = 0.2  # of a stream's newest gap between requests in its moving average


class Worker(Protocol):
    """What the combiner needs of the worker core (expertmesh/worker/core.py), which owns it."""

    _serial: threading.Lock

    def forward_into_alone(self, req: ExpertRequest, out: torch.Tensor) -> None: ...
    def check(self, req: ExpertRequest) -> ExpertRequest: ...
    def count_error(self, err: ExpertMeshError | None = None) -> None: ...
    def _compute_locked(
        self, req: ExpertRequest, to_host: bool, into: torch.Tensor | None = None, loaded: object = None
    ) -> torch.Tensor: ...


@dataclass(eq=False)
class _Waiting:
    req: ExpertRequest
    out: torch.Tensor  # [T, H] where its answer goes
    done: bool = False
    taken: bool = False  # a thread took it to compute (set under the combiner's lock)
    error: ExpertMeshError | None = None
    key: tuple = field(default=())


@dataclass
class _Stream:
    """The last request one stream (a fast-path channel's thread) sent."""

    at: float  # its clock time
    layer: int
    family: tuple | None  # its batch key without the layer; None: never combined
    gap: float | None = None  # seconds between its requests (moving average); None: one so far


@dataclass
class CombineStats:
    batches: int = 0  # combined computations of more than one request
    combined: int = 0  # requests in them
    waits: int = 0  # requests held for other streams
    met: int = 0  # ... whose awaited streams came (or whose batch another thread computed)
    wait_seconds: float = 0.0  # their time held


def batch_key(req: ExpertRequest) -> tuple | None:
    """Requests with the same key may be computed as one; None: never combined."""
    if req.adapter_slots is not None or req.rows is not None:
        return None
    x = req.hidden
    return (req.layer, req.generation, req.top_k, x.device, x.dtype, req.slot_ids.device)


class StreamCombiner:
    def __init__(
        self,
        worker: Worker,
        layers: Sequence[int] = (),
        wait_us: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``layers``: the MoE layers in the order a step sends them; ``wait_us``: the longest
        hold of a request for other streams' request of its layer (0: never held)."""
        if wait_us < 0:
            raise ValueError(f"combine wait must be >= 0 us, got {wait_us}")
        self.worker = worker
        self.wait_s = wait_us / 1e6
        self.clock = clock
        self._order = {layer: i for i, layer in enumerate(layers)}
        self._ahead = max(1, len(layers) // 2)  # farthest behind (in layers) a stream is awaited
        self._waiting: list[_Waiting] = []
        self._streams: dict[int, _Stream] = {}  # thread id -> its last request
        self._lock = threading.Lock()  # guards the above (never held while computing)
        self._arrived = threading.Condition(self._lock)  # a request came or was taken
        self.stats = CombineStats()

    @property
    def batches(self) -> int:
        return self.stats.batches

    @property
    def combined(self) -> int:
        return self.stats.combined

    def forward_into(self, req: ExpertRequest, out: torch.Tensor) -> None:
        """The worker's ``forward_into``, combined with the requests of other streams."""
        key = batch_key(req)
        w = self.worker
        if key is None:
            if self.wait_s > 0:
                with self._lock:  # NOTE: so that nobody waits for this stream's layer
                    self._saw(req.layer, None, self.clock())
                    self._arrived.notify_all()  # ... nor goes on waiting for it
            w.forward_into_alone(req, out)
            return
        me = _Waiting(req, out, key=key)
        with self._lock:
            self._waiting.append(me)
            if self.wait_s > 0:
                now = self.clock()
                awaited = self._awaited(key, now)
                self._saw(req.layer, key[1:], now)
                self._arrived.notify_all()
                if awaited:
                    self._hold(me, awaited, now)
        with w._serial:
            if not me.done:
                self._run(key)
        if me.error is not None:
            w.count_error(me.error)
            raise me.error

    # ------------------------------------------------------------ meeting (under self._lock)

    def _saw(self, layer: int, family: tuple | None, now: float) -> None:
        me = threading.get_ident()
        prev = self._streams.get(me)
        gap = None
        if prev is not None and now - prev.at <= ACTIVE_S:
            d = now - prev.at
            gap = d if prev.gap is None else prev.gap + GAP_WEIGHT * (d - prev.gap)
        self._streams[me] = _Stream(now, layer, family, gap)

    def _behind(self, s: _Stream, layer: int) -> bool:
        """Whether stream ``s`` is expected to send ``layer`` soon (its last layer is 1 to
        ``_ahead`` layers before it in the step's order)."""
        n = len(self._order)
        at, last = self._order.get(layer), self._order.get(s.layer)
        return at is not None and last is not None and 1 <= (at - last) % n <= self._ahead

    def _awaited(self, key: tuple, now: float) -> list[int]:
        """The other streams this request of ``key`` may wait for; drops idle streams."""
        me, family, layer = threading.get_ident(), key[1:], key[0]
        out = []
        for sid, s in list(self._streams.items()):
            if now - s.at > ACTIVE_S:
                del self._streams[sid]
            elif sid != me and s.family == family and self._behind(s, layer):
                out.append(sid)
        return out

    def _hold(self, me: _Waiting, awaited: list[int], since: float) -> None:
        """Waits (releasing the lock) until every awaited stream's request for this layer came
        or it moved on, another thread took ``me``, or its deadline: ``wait_s`` after it came,
        or sooner, the longest of the awaited streams' gaps between their requests."""
        layer = me.key[0]
        gaps = [g for sid in awaited if (g := self._streams[sid].gap) is not None]
        # NOTE: a stream that has not sent its next layer within its usual gap has stalled (its
        # step's end, a prefill): holding longer for it only slows this stream
        deadline = since + (min(self.wait_s, max(gaps)) if len(gaps) == len(awaited) else self.wait_s)
        pending = awaited
        while not me.taken:
            pending = [
                sid for sid in pending if (s := self._streams.get(sid)) is not None and self._behind(s, layer)
            ]
            left = deadline - self.clock()
            if not pending or left <= 0:
                break
            self._arrived.wait(left)
        st = self.stats
        st.waits += 1
        if me.taken or not pending:
            st.met += 1
        st.wait_seconds += self.clock() - since

    # ------------------------------------------------------------ compute

    def _run(self, key: tuple) -> None:
        """Under the worker's lock: computes every waiting request of ``key``."""
        with self._lock:
            mine = [x for x in self._waiting if x.key == key]
            self._waiting = [x for x in self._waiting if x.key != key]
            for x in mine:
                x.taken = True
            self._arrived.notify_all()  # NOTE: the held ones among them stop waiting
        ok: list[_Waiting] = []
        for x in mine:
            try:
                x.req = self.worker.check(x.req)  # NOTE: may be renumbered to the live generation
                ok.append(x)
            except ExpertMeshError as e:
                x.error = e
        try:
            if len(ok) == 1:
                self.worker._compute_locked(ok[0].req, False, ok[0].out)
            elif ok:
                self._together(ok)
        except ExpertMeshError as e:  # the computation itself failed: every request in it
            for x in ok:
                x.error = e
        except Exception as e:  # noqa: BLE001 - a bug must fail the requests, never pass as answers
            for x in ok:
                x.error = Internal(f"{type(e).__name__}: {e}")
        finally:
            for x in mine:
                x.done = True

    def _together(self, ok: list[_Waiting]) -> None:
        first = ok[0].req
        req = ExpertRequest(
            first.seq,
            first.generation,
            first.layer,
            torch.cat([x.req.hidden for x in ok]),  # [sum T, H]
            torch.cat([x.req.slot_ids for x in ok]),  # [sum T, K]
            torch.cat([x.req.weights for x in ok]),  # [sum T, K]
        )
        dst = self.worker._compute_locked(req, False)  # [sum T, H] on the server's device
        at = 0
        for x in ok:
            t = x.req.tokens
            x.out.copy_(dst[at : at + t], non_blocking=x.out.is_cuda)
            at += t
        self.stats.batches += 1
        self.stats.combined += len(ok)
