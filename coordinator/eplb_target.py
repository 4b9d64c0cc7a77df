"""EPLB's view of the expert servers: live placement, slot capacities, and the two-phase push.

PREPARE goes to every server (they stage the new slots beside the live ones while serving goes
on); any failure ABORTs the prepared ones and the old placement stays. Then, between two steps
(``between_steps``), the coordinator switches its placement and COMMITs on every server; a
server whose commit fails is marked unavailable and gets the live placement when it is brought
back before the next step. The manager (coordinator/eplb/manager.py) only sees this interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import torch

from coordinator.expert_conn import ExpertServerError, _status_error
from coordinator.remote import RemoteDispatcher
from expertmesh import placement as pl
from expertmesh.v1 import expert_worker_pb2 as pb


class DispatcherTarget:
    # what a push can raise: a server failed, or the placement does not fit
    errors: tuple[type[Exception], ...] = (ExpertServerError, pl.PlacementError, ValueError)

    def __init__(self, d: RemoteDispatcher, timeout_s: float) -> None:
        self.d, self.timeout_s = d, timeout_s

    def live_placement(self) -> pl.Placement:
        return self.d.placement

    def slot_capacity(self) -> torch.Tensor:  # [S]
        caps = []
        for c in self.d.conns:
            if c.info is None:
                raise ExpertServerError(
                    grpc.StatusCode.UNAVAILABLE, f"{c.spec.name} has not been described yet"
                )
            caps.append(c.info.slot_capacity)
        return torch.tensor(caps, dtype=torch.long)

    def default_speed(self) -> torch.Tensor:  # [S] equal until the servers' times are measured
        return torch.ones(len(self.d.conns), dtype=torch.float64)

    def push(self, new: pl.Placement, between_steps: Callable[[Callable[[], object]], Future]) -> list[str]:
        d = self.d
        if d.full_server is not None:
            raise ValueError("EPLB does not yet re-place with --gpu-prefill-token-threshold")
        # NOTE: all or nothing: a server that is down now would miss the prepare
        if not d.ready():
            raise ExpertServerError(
                grpc.StatusCode.UNAVAILABLE,
                "not every expert server is ready: " + ", ".join(f"{c.spec.name} {c.state}" for c in d.conns),
            )
        new.validate()
        tables = [new.server_slots(i) for i in range(len(d.conns))]
        for c, table in zip(d.conns, tables):
            need = max((len(x) for x in table.values()), default=0)
            cap = c.info.slot_capacity if c.info is not None else 0
            if need > cap:
                raise pl.PlacementError(
                    f"{c.spec.name} holds at most {cap} slots per layer, the plan gives it {need}"
                )
        gen = new.generation
        prepared = []
        try:
            for c, table in zip(d.conns, tables):
                c.push(gen, table, self.timeout_s)
                prepared.append(c)
        except grpc.RpcError as e:
            abort = pb.ApplyPlacementRequest(phase=pb.ApplyPlacementRequest.ABORT, generation=gen)
            for c in prepared:
                with contextlib.suppress(grpc.RpcError):
                    c.stub.ApplyPlacement(abort, timeout=self.timeout_s)
            raise _status_error(d.conns[len(prepared)].spec, e) from None
        failed: list[str] = []

        def switch() -> None:  # between steps, on the serving thread
            d.placement, d.tables = new, tables
            for c in d.conns:
                try:
                    c.commit(gen, self.timeout_s)
                except grpc.RpcError as e:
                    c.state, c.last_error = "unavailable", str(_status_error(c.spec, e))
                    c.reset("commit failed")
                    failed.append(c.spec.name)

        between_steps(switch).result()
        return failed
