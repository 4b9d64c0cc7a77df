"""``expertmesh load --addr HOST:PORT [--top 3] [--json]``: the coordinator's expert load.

Per MoE layer: the hottest experts of the load window (share of the layer's routed tokens) and
the per-server balance (max / mean of the window tokens each server serves under the live
placement); then a one-line summary over layers. ``--json`` prints the raw counts instead.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from expertmesh import connect
from expertmesh.v1 import admin_pb2, admin_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    connect.add_arguments(p, admin=True)
    p.add_argument("--top", type=int, default=3, help="hot experts shown per layer")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    p.add_argument("--timeout", type=float, default=10.0)


def format_load(load: admin_pb2.ExpertLoad, top: int) -> str:
    lines = [f"window: last {load.window_steps} of {load.steps} steps"]
    names = [s.name for s in load.servers]
    header = f"{'layer':>5}  {'hot experts (share of window)':<44}"
    if names:
        header += "  " + "  ".join(f"{n:>9}" for n in names) + "  max/mean"
    lines.append(header)
    ratios = []
    for i, layer in enumerate(load.layers):
        counts = list(layer.window_tokens)
        total = sum(counts) or 1
        hot = sorted(range(len(counts)), key=lambda e: -counts[e])[:top]
        text = ", ".join(f"{e} ({counts[e] / total:.0%})" for e in hot)
        row = f"{layer.layer:>5}  {text:<44}"
        if names:
            per = [s.window_tokens[i] for s in load.servers]
            mean = sum(per) / len(per)
            ratio = max(per) / mean if mean else 1.0
            ratios.append(ratio)
            row += "  " + "  ".join(f"{x:>9.0f}" for x in per) + f"  {ratio:8.3f}"
        lines.append(row)
    if ratios:
        lines.append(
            f"per-server balance (max/mean): mean {sum(ratios) / len(ratios):.3f}, worst {max(ratios):.3f}"
        )
        for s in load.servers:
            if s.compute_ms > 0:
                lines.append(
                    f"{s.name}: {s.computed_tokens:.0f} tokens in {s.compute_ms:.1f} ms "
                    f"({s.computed_tokens / s.compute_ms:.1f} tokens/ms)"
                )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        with connect.open_channel(args) as ch:
            load = admin_pb2_grpc.AdminStub(ch).GetExpertLoad(
                admin_pb2.GetExpertLoadRequest(), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"error: {connect.describe_error(e, args)}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "window_steps": load.window_steps,
                    "steps": load.steps,
                    "layers": {
                        str(x.layer): {"window": list(x.window_tokens), "total": list(x.tokens)}
                        for x in load.layers
                    },
                    "servers": {s.name: list(s.window_tokens) for s in load.servers},
                }
            )
        )
        return 0
    print(format_load(load, args.top))
    return 0
