"""What ``Admin/ListServers`` adds for the operator view (``expertmesh status``): per-server
round-trip totals and the coordinator's own numbers (fields 140+ of admin.proto)."""

from __future__ import annotations

import time
from typing import Any

from expertmesh.v1 import admin_pb2


def add_status(coord: Any, resp: admin_pb2.ListServersResponse) -> None:
    m = coord.metrics
    for info in resp.servers:
        count, seconds = m.round_trips.get(info.name, (0, 0.0))
        info.layer_round_trips, info.layer_round_trip_seconds = int(count), float(seconds)
    st = coord.scheduler.stats()
    placement = coord.cluster.placement if coord.cluster is not None else None
    resp.coordinator.CopyFrom(
        admin_pb2.CoordinatorStats(
            requests_running=st["running"],
            requests_waiting=st["waiting"],
            kv_pages_used=st["total_pages"] - st["free_pages"],
            kv_pages_total=st["total_pages"],
            kv_page_size=coord.scheduler.engine.page_size,
            requests_finished=m.finished,
            prompt_tokens=m.prompt_total,
            generation_tokens=m.generated_total,
            steps=st["steps"],
            preemptions=st["preemptions"],
            uptime_seconds=time.monotonic() - m.started,
            placement_generation=placement.generation if placement is not None else 0,
            prompt_tokens_cached=m.prompt_cached_total,
            kv_pages_cached=st["cached_pages"],
            linked_decode_steps=getattr(coord.dispatcher, "linked_steps", 0),
        )
    )
