"""Admin-plane converters for EPLB: manager outcomes, status and the load window to protobuf.

The only EPLB code that touches ``*_pb2`` types; the servicer methods call these.
"""

from __future__ import annotations

import json

import torch

from coordinator.eplb.hetero import slot_shares
from coordinator.eplb.manager import EplbManager, Outcome
from coordinator.experts.load_recorder import LoadSnapshot
from expertmesh import placement as pl
from expertmesh.v1 import admin_pb2


def outcome_pb(out: Outcome) -> admin_pb2.RebalanceOutcome:
    msg = admin_pb2.RebalanceOutcome(
        outcome=out.kind,
        trigger=out.trigger,
        error=out.error,
        generation=out.generation,
        prepare_ms=out.prepare_ms,
        commit_ms=out.commit_ms,
        unix_time=out.at,
        window_tokens=out.window_tokens,
        load_source=out.load_source,
    )
    p = out.plan
    if p is not None:
        msg.reason = p.reason
        msg.token_balance_before, msg.token_balance_after = p.token_balance_before, p.token_balance_after
        msg.time_before, msg.time_after = p.time_before, p.time_after
        msg.weights_moved, msg.bytes_moved, msg.compute_ms = p.weights_moved, p.bytes_moved, p.compute_ms
        msg.layers_kept, msg.layers_searched, msg.layers_scratch = (
            p.layers_kept,
            p.layers_searched,
            p.layers_scratch,
        )
        if p.placement is not None:
            msg.placement_json = json.dumps(p.placement.to_json())
    return msg


def status_pb(m: EplbManager, replica_policy: str) -> admin_pb2.EplbStatus:
    c = m.counters
    return admin_pb2.EplbStatus(
        interval_steps=m.cfg.interval_steps,
        window_steps=m.cfg.window_steps,
        redundant_slots=m.cfg.redundant_slots,
        replica_policy=replica_policy,
        rebalanced=c.rebalanced,
        skipped=c.skipped,
        failed=c.failed,
        dry_runs=c.dry_runs,
        history=[outcome_pb(o) for o in list(c.history)],
    )


def server_window_tokens(snap: LoadSnapshot, placement: pl.Placement) -> torch.Tensor:  # [S, L]
    """Window tokens each server serves under ``placement`` (replicas split evenly)."""
    out = torch.zeros(len(placement.servers), len(snap.moe_layers), dtype=torch.float64)
    for row, layer in enumerate(snap.moe_layers):
        lp = placement.layers[layer]
        share = slot_shares(snap.window[row : row + 1].double(), torch.tensor([lp.phy2log]))[0]  # [P]
        out[:, row].index_add_(0, torch.tensor(lp.owner, dtype=torch.long), share)
    return out


def load_pb(snap: LoadSnapshot, placement: pl.Placement | None) -> admin_pb2.ExpertLoad:
    msg = admin_pb2.ExpertLoad(
        layers=[
            admin_pb2.LayerLoad(
                layer=layer, tokens=snap.totals[i].tolist(), window_tokens=snap.window[i].tolist()
            )
            for i, layer in enumerate(snap.moe_layers)
        ],
        window_steps=snap.window_steps,
        steps=snap.steps,
    )
    if placement is not None:
        tokens = server_window_tokens(snap, placement)
        n = snap.server_ms.shape[0]
        for s, name in enumerate(placement.servers):
            msg.servers.append(
                admin_pb2.ServerLoad(
                    name=name,
                    window_tokens=tokens[s].tolist(),
                    compute_ms=float(snap.server_ms[s].sum()) if s < n else 0.0,
                    computed_tokens=float(snap.server_tokens[s].sum()) if s < n else 0.0,
                )
            )
    return msg
