"""``expertmesh status --addr HOST:PORT [--watch]``: the operator's view of a running cluster.

Reads the coordinator's Admin API (ListServers, GetPlacement, GetExpertLoad) twice,
``--interval`` seconds apart, and prints: the expert servers (state, data path, slots in use,
mean MoE-layer round trip over the interval), the placement generation, requests running and
waiting, KV cache use, throughput over the interval and the hottest experts of each layer
(share of routed tokens since start). ``--watch`` repeats until Ctrl-C; ``--json`` prints one
JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from expertmesh import connect
from expertmesh.v1 import admin_pb2, admin_pb2_grpc

ERROR_WIDTH = 120  # characters of a server's last error shown under the table


def add_arguments(p: argparse.ArgumentParser) -> None:
    connect.add_arguments(p, admin=True)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between the two readings")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C")
    p.add_argument("--top", type=int, default=3, help="hottest experts shown per layer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per Admin call")


def read(stub: admin_pb2_grpc.AdminStub, timeout: float) -> dict[str, Any]:
    servers = stub.ListServers(admin_pb2.ListServersRequest(), timeout=timeout)
    load = stub.GetExpertLoad(admin_pb2.GetExpertLoadRequest(), timeout=timeout)
    return {
        "t": time.monotonic(),
        "servers": servers,
        "load": {ly.layer: list(ly.tokens) for ly in load.layers},
    }


def summarize(a: dict[str, Any], b: dict[str, Any], top: int) -> dict[str, Any]:
    """Two readings -> the numbers shown (rates over the time between them)."""
    dt = max(b["t"] - a["t"], 1e-9)
    ca, cb = a["servers"].coordinator, b["servers"].coordinator
    before = {s.name: s for s in a["servers"].servers}
    servers = []
    for s in b["servers"].servers:
        p = before.get(s.name)
        n = s.layer_round_trips - (p.layer_round_trips if p else 0)
        secs = s.layer_round_trip_seconds - (p.layer_round_trip_seconds if p else 0.0)
        servers.append(
            {
                "name": s.name, "address": s.address, "kind": s.kind, "state": s.state,
                "transport": s.transport or "-", "link": s.link or "-", "link_note": s.link_note,
                "slots_used": s.slots_used, "slot_capacity": s.slot_capacity,
                "layer_round_trip_ms": secs / n * 1e3 if n else None, "last_error": s.last_error,
            }
        )  # fmt: skip
    hottest = {}
    for layer, tokens in sorted(b["load"].items()):
        total = sum(tokens) or 1
        order = sorted(range(len(tokens)), key=lambda e: -tokens[e])[:top]
        hottest[layer] = [(e, tokens[e] / total) for e in order if tokens[e]]
    return {
        "uptime_seconds": cb.uptime_seconds,
        "placement_generation": cb.placement_generation,
        "requests": {
            "running": cb.requests_running,
            "waiting": cb.requests_waiting,
            "finished": cb.requests_finished,
        },
        "kv": {
            "pages_used": cb.kv_pages_used,
            "pages_total": cb.kv_pages_total,
            "page_size": cb.kv_page_size,
            "pages_cached": cb.kv_pages_cached,
        },
        "throughput": {
            "interval_seconds": dt,
            "generation_tokens_per_s": (cb.generation_tokens - ca.generation_tokens) / dt,
            "prompt_tokens_per_s": (cb.prompt_tokens - ca.prompt_tokens) / dt,
            "prompt_tokens_cached_per_s": (cb.prompt_tokens_cached - ca.prompt_tokens_cached) / dt,
            "requests_per_s": (cb.requests_finished - ca.requests_finished) / dt,
            "steps_per_s": (cb.steps - ca.steps) / dt,
            "linked_steps_per_s": (cb.linked_decode_steps - ca.linked_decode_steps) / dt,
        },
        "servers": servers,
        "hottest_experts": hottest,
    }


def render(addr: str, s: dict[str, Any]) -> str:
    up = int(s["uptime_seconds"])
    r, kv, tp = s["requests"], s["kv"], s["throughput"]
    share = kv["pages_used"] / kv["pages_total"] * 100 if kv["pages_total"] else 0.0
    lines = [
        f"coordinator {addr}: up {up // 3600}h{up // 60 % 60:02d}m{up % 60:02d}s, "
        f"placement generation {s['placement_generation']}",
        f"requests: {r['running']} running, {r['waiting']} waiting, {r['finished']} finished",
        f"KV cache: {kv['pages_used']}/{kv['pages_total']} pages used ({share:.1f}%), {kv['page_size']} tokens/page, "
        f"{kv['pages_cached']} pages in the prefix cache",
        f"throughput over {tp['interval_seconds']:.1f}s: {tp['generation_tokens_per_s']:.1f} generated tok/s, "
        f"{tp['prompt_tokens_per_s']:.1f} prompt tok/s ({tp['prompt_tokens_cached_per_s']:.1f} cached), "
        f"{tp['requests_per_s']:.2f} req/s, "
        f"{tp['steps_per_s']:.1f} steps/s ({tp['linked_steps_per_s']:.1f} linked)",
        "",
    ]
    if s["servers"]:
        rows = [("SERVER", "KIND", "STATE", "TRANSPORT", "LINK", "SLOTS", "LAYER RTT", "ADDRESS")]
        for v in s["servers"]:
            rtt = f"{v['layer_round_trip_ms']:.2f} ms" if v["layer_round_trip_ms"] is not None else "-"
            slots = f"{v['slots_used']}/{v['slot_capacity']}"
            rows.append(
                (v["name"], v["kind"], v["state"], v["transport"], v["link"], slots, rtt, v["address"])
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        # NOTE: below the table, one line each: an error message would stretch every row
        lines += [f"  {v['name']}: {_short(v['last_error'])}" for v in s["servers"] if v["last_error"]]
    else:
        lines.append("expert servers: none (every expert runs in the coordinator)")
    lines += ["", "hottest experts per layer (share of routed tokens since start):"]
    for layer, top in s["hottest_experts"].items():
        text = ", ".join(f"e{e} {f * 100:.1f}%" for e, f in top) or "(no tokens yet)"
        lines.append(f"  layer {layer:>3}: {text}")
    return "\n".join(lines)


def _short(text: str, width: int = ERROR_WIDTH) -> str:
    """``text`` on one line, cut to ``width`` characters."""
    one = " ".join(text.split())
    return one if len(one) <= width else one[: width - 3] + "..."


def run(args: argparse.Namespace) -> int:
    try:
        with connect.open_channel(args) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            prev = read(stub, args.timeout)
            while True:
                time.sleep(args.interval)
                cur = read(stub, args.timeout)
                s = summarize(prev, cur, args.top)
                if args.json:
                    print(json.dumps(s), flush=True)
                else:
                    print(("\x1b[H\x1b[2J" if args.watch else "") + render(args.addr, s), flush=True)
                if not args.watch:
                    return 0
                prev = cur
    except grpc.RpcError as e:
        print(f"error: {connect.describe_error(e, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0 if args.watch else 130
