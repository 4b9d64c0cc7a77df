"""Two coordinators sharing one GPU expert server vs one coordinator, at the same total
concurrency: aggregate output tokens/s and the expert server's batch size per layer call.

    python benchmarks/bench_two_coordinators.py [--model DIR | --widths qwen3-30b-a3b --layers 4]
        [--server-device cuda:0] [--coord-devices cuda:0 cuda:0] [--concurrency 16 64]
        [--new-tokens 64] [--coord-flags "--dtype bfloat16"] [--server-flags "--dtype bfloat16"]
        [--combine-too [--combine-wait-us 0 200]]

For each level and mode a fresh GPU expert server (every expert) and fresh coordinators start
with the real CLI (``--placement-lease``, so they share the server; the first one places the
experts, the second follows):

  one             a single coordinator (the first of ``--coord-devices``) with all ``c`` clients;
  two             two coordinators (``--coord-devices``: one per GPU, or both on one), ``c/2``
                  clients each;
  two, combined   (``--combine-too``) the same on a server started with ``--combine-streams``,
                  once per ``--combine-wait-us`` value (how long a request may be held for the
                  other coordinator's request of its layer; 0: only requests that already
                  wait together are combined).

Clients are closed-loop (each sends its next request when the previous one finished), greedy
with ``ignore_eos``, ``max(2c, 8)`` requests per level after one warm-up request per client.
The server's rows per layer call come from its ``Stats`` (tokens / requests over the level):
without ``--combine-streams`` each layer call carries one coordinator's rows; with it, the
requests of both that wait for the same layer are one call (expertmesh/worker/combine.py).
The combined rows also report, from the server's /metrics, the requests held for the other
coordinator and how many of them met it, and the mean hold.

On a machine without a GPU everything runs on the CPU (``--server-device cpu``): a smoke run
of the protocol, not a speed figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpc  # noqa: E402
from bench_serving import prepare_model  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from expertmesh.client import AsyncClient  # noqa: E402
from expertmesh.health import check  # noqa: E402
from expertmesh.v1 import expert_worker_pb2 as pb  # noqa: E402
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc  # noqa: E402
from expertmesh.worker.config import COMBINE_WAIT_US  # noqa: E402

LISTEN = r"listening on (\S+):(\d+)"
COORD_LISTEN = r"coordinator listening on (\S+):(\d+)"
METRICS = r"Prometheus metrics on (\S+)"


@dataclass
class Proc:
    proc: subprocess.Popen
    addr: str
    log: object

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start(
    cmd: list[str], pattern: str, threads: int, timeout: float = 300.0, env: dict | None = None
) -> Proc:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **(env or {}))
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (open as long as the child runs)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        m = re.search(pattern, line)
        if m:
            proc = Proc(p, f"{m.group(1)}:{m.group(2)}", log)
            while check(proc.addr, 1.0) != "SERVING":
                if time.monotonic() > deadline:
                    proc.stop()
                    raise RuntimeError(f"{cmd[3]} at {proc.addr} never became SERVING")
                time.sleep(0.2)
            return proc
    log.seek(0)
    raise RuntimeError(f"{' '.join(cmd)} exited with {p.wait()}:\n{log.read()[-3000:]}")


def server_counts(addr: str) -> tuple[int, int]:
    """(layer calls, rows) the expert server computed since it started."""
    with grpc.insecure_channel(addr) as ch:
        s = pb_grpc.ExpertWorkerStub(ch).Stats(pb.StatsRequest(), timeout=10)
    return int(s.requests), int(s.tokens)


def metrics_url(server: Proc) -> str:
    """The /metrics address the server prints after its listening line (``--metrics-port 0``)."""
    assert server.proc.stdout is not None
    for line in server.proc.stdout:
        m = re.search(METRICS, line)
        if m:
            return m.group(1)
    raise RuntimeError("the expert server printed no metrics address")


def held(url: str) -> tuple[float, float, float]:
    """(requests held, of them met, seconds held) since the server started."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got = {"met": 0.0, "timed_out": 0.0, "s": 0.0}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "expertmesh_worker_combine_waits_total":
                got[sample.labels["outcome"]] = sample.value
            elif sample.name == "expertmesh_worker_combine_wait_seconds_total":
                got["s"] = sample.value
    return got["met"] + got["timed_out"], got["met"], got["s"]


async def client_loop(addr: str, prompts: list[list[int]], new_tokens: int) -> int:
    made = 0
    async with AsyncClient(addr, timeout=600) as c:
        for ids in prompts:
            async for chunk in c.stream(input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True):
                made += len(chunk.token_ids)
    return made


async def run_level(
    addrs: list[str], c: int, n_requests: int, prompt_tokens: int, new_tokens: int, vocab: int
) -> tuple[int, float]:
    rng = random.Random(c)
    per_client = [max(1, n_requests // c)] * c

    def prompts(k: int) -> list[list[int]]:
        return [[rng.randrange(2, vocab) for _ in range(prompt_tokens)] for _ in range(k)]

    # warm-up: one request per client
    await asyncio.gather(*(client_loop(addrs[i % len(addrs)], prompts(1), 2) for i in range(c)))
    t0 = time.perf_counter()
    made = await asyncio.gather(
        *(client_loop(addrs[i % len(addrs)], prompts(per_client[i]), new_tokens) for i in range(c))
    )
    return sum(made), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument(
        "--widths",
        default=None,
        choices=["qwen3-30b-a3b", "deepseek-v2-lite"],
        help="instead of --model: a random checkpoint of these real widths (bench_e2e.py's), --layers deep",
    )
    ap.add_argument("--layers", type=int, default=4, help="with --widths: decoder layers")
    ap.add_argument(
        "--server-device", default="cpu", help="the expert server's device (cuda:0 on the device)"
    )
    ap.add_argument("--coord-devices", nargs=2, default=["cpu", "cpu"], metavar="DEV")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(2c, 8))")
    ap.add_argument(
        "--combine-too",
        action="store_true",
        help="also run two coordinators on a server started with --combine-streams",
    )
    ap.add_argument(
        "--combine-wait-us",
        type=float,
        nargs="+",
        default=[COMBINE_WAIT_US],
        help="with --combine-too: one combined row per value of the server's --combine-wait-us",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--coord-flags", default="", help="extra coordinator flags, one string")
    ap.add_argument("--server-flags", default="", help="extra expert-server flags, one string")
    ap.add_argument(
        "--device-link",
        choices=["auto", "on", "off"],
        default="auto",
        help="the server's device link (auto: off when two of the processes share a GPU)",
    )
    args = ap.parse_args()
    # NOTE: two coordinators on one GPU, each with a device link, time-slice that GPU between
    # two contexts whose step graphs spin on link flags (expertmesh/transport/link.py): a
    # measured 10x loss (441 -> 45 tok/s at c=8, full size, 2x H200). Off, every coordinator
    # runs the piecewise path, the same for the one-coordinator row of the comparison.
    # (a coordinator on the server's own GPU likewise: the server's step graphs spin there)
    cuda = [d for d in (*args.coord_devices, args.server_device) if d.startswith("cuda")]
    shared_gpu = len(cuda) != len(set(cuda))
    link_off = args.device_link == "off" or (args.device_link == "auto" and shared_gpu)
    server_env = {"EXPERTMESH_LINK": "0"} if link_off else None
    print(f"device link: {'off' if link_off else 'on'}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if args.widths:
            import torch
            from bench_e2e import MODELS, write_checkpoint

            model = Path(tmp) / args.widths
            write_checkpoint(model, MODELS[args.widths], args.layers, torch.bfloat16, "cpu")
            what = f"{args.widths} widths, {args.layers} layers, random bf16 weights"
        else:
            model, what = prepare_model(args.model, Path(tmp))
        from expertmesh.checkpoint import CheckpointReader

        vocab = CheckpointReader(str(model)).config.vocab_size
        cli = [sys.executable, "-m", "expertmesh.cli"]
        modes: list[tuple[str, list[str], float | None]] = [
            ("one", args.coord_devices[:1], None),
            ("two", args.coord_devices, None),
        ]
        if args.combine_too:
            for w in args.combine_wait_us:
                modes.append((f"two, combined, wait {w:g} us", args.coord_devices, w))
        rows = []
        for c in args.concurrency:
            n = args.requests or max(2 * c, 8)
            for mode, devs, wait_us in modes:
                # NOTE: a fresh server per run: its counts and caches start from the same state
                server_cmd = [*cli, "gpu-server", "--model", str(model), "--port", "0"]
                server_cmd += ["--device", args.server_device, *args.server_flags.split()]
                if wait_us is not None:
                    server_cmd += ["--combine-streams", "--combine-wait-us", f"{wait_us:g}"]
                    server_cmd += ["--metrics-port", "0"]
                server = start(server_cmd, LISTEN, args.threads, env=server_env)
                url = metrics_url(server) if wait_us is not None else ""
                coords: list[Proc] = []
                try:
                    for dev in devs:
                        cmd = [*cli, "coordinator", "--model", str(model), "--port", "0", "--device", dev]
                        cmd += ["--threads", str(args.threads), "--gpu-server", server.addr]
                        cmd += ["--placement-lease", "5", *args.coord_flags.split()]
                        coords.append(start(cmd, COORD_LISTEN, args.threads))
                    calls0, toks0 = server_counts(server.addr)
                    held0 = held(url) if url else (0.0, 0.0, 0.0)
                    addrs = [p.addr for p in coords]
                    made, secs = asyncio.run(
                        run_level(addrs, c, n, args.prompt_tokens, args.new_tokens, vocab)
                    )
                    calls1, toks1 = server_counts(server.addr)
                    held1 = held(url) if url else (0.0, 0.0, 0.0)
                finally:
                    for p in coords:
                        p.stop()
                    server.stop()
                calls, toks = calls1 - calls0, toks1 - toks0
                n_held, n_met, s_held = (b - a for a, b in zip(held0, held1))
                waits = f"{n_held:.0f} / {n_met:.0f} / {s_held / max(1, n_held) * 1e6:.0f}" if url else ""
                rows.append((c, mode, made / secs, toks / max(1, calls), calls, waits))
                print(
                    f"c={c} {mode}: {made / secs:.1f} tok/s, {toks / max(1, calls):.1f} rows per layer call"
                    + (f", held / met / mean hold us: {waits}" if url else "")
                )
    print(
        f"\nmodel: {what}; expert server on {args.server_device}; coordinators on {' / '.join(args.coord_devices)}"
    )
    print(
        "| total concurrency | coordinators | aggregate tok/s | vs one | server rows per layer call "
        "| layer calls | held / met / mean hold (us) |"
    )
    print("|---|---|---|---|---|---|---|")
    base = {c: tps for c, mode, tps, *_ in rows if mode == "one"}
    for c, mode, tps, per_call, calls, waits in rows:
        print(f"| {c} | {mode} | {tps:.1f} | {tps / base[c]:.2f}x | {per_call:.1f} | {calls} | {waits} |")


if __name__ == "__main__":
    main()
