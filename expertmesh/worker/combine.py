"""Cross-stream batching on an expert server (opt-in, ``--combine-streams``): fast-path
requests for the same layer that wait while the server computes are computed together.

Several coordinators sharing a server each send one layer at a time; their requests for a
layer reach the server on their own channel threads and, without this, are computed one after
the other, each on few rows. Here each waiting request is put on a list before its thread
waits for the worker's lock; the thread that gets the lock takes every request on the list
that can share its batch (same layer, generation, top-k, device and dtype, no MoE LoRA),
checks each one (a bad one fails alone, never its neighbours), computes them as one
``[sum T, H]`` request and copies each answer into its own output; the threads whose requests
it took find them done when they get the lock.

What it costs: a request computed alone loses the early input copy of a graphed GPU backend
(``load_input``); requests naming adapters are never combined.

Shapes: T tokens of one request, H hidden, K top-k.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from expertmesh.errors import ExpertMeshError, Internal
from expertmesh.worker_api import ExpertRequest


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
    error: ExpertMeshError | None = None
    key: tuple = field(default=())


def batch_key(req: ExpertRequest) -> tuple | None:
    """Requests with the same key may be computed as one; None: never combined."""
    if req.adapter_slots is not None or req.rows is not None:
        return None
    x = req.hidden
    return (req.layer, req.generation, req.top_k, x.device, x.dtype, req.slot_ids.device)


class StreamCombiner:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._waiting: list[_Waiting] = []
        self._lock = threading.Lock()  # guards _waiting (never held while computing)
        self.batches = 0  # combined computations of more than one request
        self.combined = 0  # requests in them

    def forward_into(self, req: ExpertRequest, out: torch.Tensor) -> None:
        """The worker's ``forward_into``, combined with the requests waiting beside it."""
        key = batch_key(req)
        w = self.worker
        if key is None:
            w.forward_into_alone(req, out)
            return
        me = _Waiting(req, out, key=key)
        with self._lock:
            self._waiting.append(me)
        with w._serial:
            if not me.done:
                self._run(key)
        if me.error is not None:
            w.count_error(me.error)
            raise me.error

    def _run(self, key: tuple) -> None:
        """Under the worker's lock: computes every waiting request of ``key``."""
        with self._lock:
            mine = [x for x in self._waiting if x.key == key]
            self._waiting = [x for x in self._waiting if x.key != key]
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
        self.batches += 1
        self.combined += len(ok)
