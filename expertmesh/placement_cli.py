"""``expertmesh placement show|set FILE|rebalance [--dry-run] --addr HOST:PORT``.

- ``show``: the live placement as a placement file (JSON), with its generation (and, when
  several coordinators share the servers, which of them places the experts) on stderr.
- ``set FILE``: push a placement file (two phases; the old placement stays on any failure).
- ``rebalance [--dry-run]``: run EPLB now; with ``--dry-run`` only print the plan and its
  predicted balance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from expertmesh import connect
from expertmesh.v1 import admin_pb2, admin_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "set", "rebalance"])
    p.add_argument("file", nargs="?", help="placement file (for set)")
    connect.add_arguments(p, admin=True)
    p.add_argument("--dry-run", action="store_true", help="rebalance: plan only, push nothing")
    p.add_argument("--timeout", type=float, default=300.0)


def placement_json(info: admin_pb2.PlacementInfo) -> dict:
    layers: dict[str, dict[str, list[int]]] = {}
    for lp in info.layers:
        slots: dict[str, list[tuple[int, int]]] = {name: [] for name in info.servers}
        for e, o, s in zip(lp.phy2log, lp.owner, lp.local_slot):
            slots[info.servers[o]].append((s, e))
        layers[str(lp.layer)] = {name: [e for _, e in sorted(v)] for name, v in slots.items()}
    return {"servers": list(info.servers), "layers": layers}


def format_outcome(o: admin_pb2.RebalanceOutcome) -> str:
    lines = [
        f"{o.outcome} ({o.trigger}): {o.reason or o.error}",
        f"  live generation {o.generation}",
        f"  per-server token balance (max/mean, mean over layers): {o.token_balance_before:.3f} -> "
        f"{o.token_balance_after:.3f}",
        f"  slowest-server time (sum over layers, relative): {o.time_before:.4g} -> {o.time_after:.4g}",
        f"  expert weights to load: {o.weights_moved} ({o.bytes_moved / 2**20:.1f} MiB); layers kept / "
        f"searched / from scratch: {o.layers_kept} / {o.layers_searched} / {o.layers_scratch}",
        f"  plan {o.compute_ms:.1f} ms"
        + (
            f", prepare {o.prepare_ms:.0f} ms, commit {o.commit_ms:.1f} ms"
            if o.outcome == "rebalanced"
            else ""
        ),
    ]
    if o.error and o.reason:
        lines.append(f"  error: {o.error}")
    if o.placement_json:
        lines.append("plan:")
        plan = json.loads(o.placement_json)
        for layer, lists in plan["layers"].items():
            lines.append(f"  layer {layer}: " + "  ".join(f"{n}={v}" for n, v in lists.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        with connect.open_channel(args) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            if args.action == "show":
                info = stub.GetPlacement(admin_pb2.GetPlacementRequest(), timeout=args.timeout)
                print(f"generation {info.generation}", file=sys.stderr)
                if info.placement_holder:  # several coordinators share the expert servers
                    role = " (this coordinator)" if info.placement_holder == info.coordinator_id else ""
                    print(f"placed by coordinator {info.placement_holder}{role}", file=sys.stderr)
                print(json.dumps(placement_json(info), indent=1))
                return 0
            if args.action == "set":
                if not args.file:
                    print("error: placement set needs a FILE", file=sys.stderr)
                    return 2
                text = Path(args.file).read_text()
                r = stub.SetPlacement(
                    admin_pb2.SetPlacementRequest(placement_json=text), timeout=args.timeout
                )
                print(f"placement generation {r.generation} live ({r.weights_moved} expert weights loaded)")
                return 0
            out = stub.Rebalance(admin_pb2.RebalanceRequest(dry_run=args.dry_run), timeout=args.timeout)
            print(format_outcome(out.outcome))
            return 1 if out.outcome.outcome == "failed" else 0
    except grpc.RpcError as e:
        print(f"error: {connect.describe_error(e, args)}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
