"""EPLB rebalancing every few steps under concurrent streaming load, through the real CLI
processes: failed requests, greedy outputs against a run without rebalancing, and the steps
that overlap a placement move against the median step.

Processes: a ``gpu-server`` (``--gpu-device``, preloading every expert) and a second expert
server (a ``cpu-server`` by default, or a second ``gpu-server`` on ``--second-device``) started
once; for each run a fresh ``coordinator`` in front of them with the same flags, except that
run B adds EPLB every ``--interval`` steps (skip and move thresholds 0: every plan that moves a
weight is pushed). Run A (no rebalancing) first serves one untimed round (the servers compile
and capture their kernels), then both runs serve ``--passes`` x ``--rounds`` rounds of
``--concurrency`` streaming greedy requests (fixed token prompts, ``ignore_eos``) with no prefix
cache, so every pass computes the same thing:

- requests ok / failed;
- greedy outputs: run B's (every pass) against run A's first pass; run A's second pass against
  its first is the control (batches of the same prompts computed twice without a move);
- steps, from the coordinator's ``expertmesh_step_seconds`` histogram (the measured passes) and
  its ``_max`` gauge: the median step (interpolated in its bucket, which spans 19%), the
  steady steps' worst (the upper bound of their last non-empty bucket), the steps that overlap
  a placement push (``placement="moving"``: prepare through commit; the commit runs between two
  steps and counts in the next step) and their exact worst; the same for decode steps alone
  (``kind="decode"``: a prefill of the concurrent prompts is many times a decode step, moves
  or not);
- every rebalance of run B (``Admin/GetEplbStatus``: the last 16): weights moved, the
  (layer, server) slot tables whose slot count changes and the slots that change (by the
  worker's own move planner: what the commits write where the tables' allocations hold their
  new sizes), prepare and commit (the between-steps switch: the servers' commits, at once)
  times; how many rebalances moved weights
  (``expertmesh_rebalances_total{result="rebalanced"}``).

Greedy equality is exact only where a moved expert computes bit for bit as before: in float32
on the demo model it holds; in bf16 an expert that changes server is computed by another
kernel and each server's partial sum is rounded before the coordinator adds them, so outputs
may part (the control row tells what batching alone does).

Here, on the demo model (CPU)::

    python benchmarks/bench_rebalance.py

Full size on a 2-GPU host (a checkpoint written by benchmarks/fullsize_ckpt.py)::

    python benchmarks/bench_rebalance.py --model /tmp/q3 --device cuda:0 --gpu-device cuda:1 \\
        --dtype bfloat16 --gpu-experts 96 --cpu-threads 24 --coordinator-threads 4 --out $OUT

(``--second gpu --second-device cuda:0``: a second GPU server instead of the CPU server.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_fullsize import _LISTEN, Proc, spawn, wait_serving  # noqa: E402
from expertmesh.client import AsyncClient  # noqa: E402
from expertmesh.config import ModelConfig  # noqa: E402
from expertmesh.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from expertmesh.worker.moves import plan_layer  # noqa: E402

CLI = [sys.executable, "-m", "expertmesh.cli"]
Outputs = dict[tuple[int, int], list[int]]  # (round, request) -> generated ids
Slots = dict[tuple[str, str], list[int]]  # (layer, server) -> expert per slot


# ---------------------------------------------------------------------- processes


def start_servers(args: argparse.Namespace, model: Path, cfg: ModelConfig, out: Path) -> list[Proc]:
    """The GPU server (every expert) and the second server (the experts >= --gpu-experts)."""
    e = cfg.num_experts
    common = ["--model", str(model), "--port", "0", "--dtype", args.dtype]
    gpu = [*CLI, "gpu-server", *common, "--device", args.gpu_device]
    if args.second == "cpu":
        share = f"{args.gpu_experts}-{e - 1}" if args.gpu_experts < e else "none"
        second = [*CLI, "cpu-server", *common, "--experts", share, "--threads", str(args.cpu_threads)]
    else:  # two GPU servers split the experts in halves (the coordinator's static split)
        second = [*CLI, "gpu-server", *common, "--device", args.second_device]
        second += ["--experts", f"{e // 2}-{e - 1}"]
    extra = args.server_flags.split()
    procs: list[Proc] = []
    try:
        for name, cmd in (("gpu0", [*gpu, *extra]), ("second", [*second, *extra])):
            procs.append(spawn(name, cmd, _LISTEN, args.startup_timeout, out / f"{name}.log"))
        for p in procs:
            wait_serving(f"127.0.0.1:{p.port}", args.startup_timeout, procs)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def coordinator_cmd(args: argparse.Namespace, model: Path, servers: list[Proc]) -> list[str]:
    gpu, second = (f"127.0.0.1:{p.port}" for p in servers)
    cmd = [*CLI, "coordinator", "--model", str(model), "--port", "0", "--http-port", "0",
           "--device", args.device, "--dtype", args.dtype, "--threads", str(args.coordinator_threads),
           "--kv-memory", args.kv_memory, "--no-prefix-cache", "--replica-policy", "load_aware",
           "--max-running-requests", str(args.concurrency), "--max-batch-tokens", str(args.max_batch_tokens),
           "--gpu-server", gpu]  # fmt: skip
    if args.second == "cpu":
        return [*cmd, "--cpu-server", second, "--num-gpu-experts", str(args.gpu_experts)]
    return [*cmd, "--gpu-server", second]


def eplb_flags(args: argparse.Namespace, time_model: str) -> list[str]:
    return ["--eplb-interval-steps", str(args.interval), "--eplb-window-steps", str(args.window),
            "--eplb-redundant-slots", str(args.redundant), "--eplb-skip-threshold", "0",
            "--eplb-move-threshold", "0", "--eplb-max-moves", str(args.max_moves),
            "--eplb-max-move-mb", str(args.max_move_mb), "--eplb-time-model", time_model]  # fmt: skip


# ---------------------------------------------------------------------- load


def prompts(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """[round][request] -> prompt ids, fixed by the seed; lengths vary so prefill mixes in."""
    g = torch.Generator().manual_seed(0)
    lo, hi = 3, vocab - 3
    return [
        [
            torch.randint(lo, hi, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(args.concurrency)
        ]
        for _ in range(args.rounds)
    ]


async def serve(addr: str, rounds: list[list[list[int]]], new_tokens: int) -> tuple[Outputs, list[str]]:
    """One pass: each round's requests streamed concurrently; (outputs of the ok ones, errors)."""
    outs: Outputs = {}
    errs: list[str] = []
    async with AsyncClient(addr, timeout=600) as client:

        async def one(key: tuple[int, int], ids: list[int]) -> None:
            got: list[int] = []
            reason = None
            try:
                async for chunk in client.stream(
                    input_ids=ids, max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True
                ):
                    got += chunk.token_ids
                    reason = chunk.finish_reason or reason
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
                errs.append(f"{key}: {type(e).__name__}: {e}")
                return
            if reason != "length" or len(got) != new_tokens:
                errs.append(f"{key}: finish {reason}, {len(got)} tokens")
                return
            outs[key] = got

        for r, batch in enumerate(rounds):
            await asyncio.gather(*(one((r, i), ids) for i, ids in enumerate(batch)))
    return outs, errs


# ---------------------------------------------------------------------- coordinator numbers


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def buckets(m0: dict, m1: dict, phase: str, kind: str | None = None) -> list[tuple[float, float]]:
    """[(upper bound, steps in this bucket)] of ``expertmesh_step_seconds`` between two scrapes,
    of one step kind (decode, prefill) or of both."""
    cum: dict[float, float] = {}
    for (name, labels), v in m1.items():
        d = dict(labels)
        if (
            name == "expertmesh_step_seconds_bucket"
            and d.get("placement") == phase
            and kind in (None, d.get("kind"))
        ):
            le = float(d["le"])
            cum[le] = cum.get(le, 0.0) + v - m0.get((name, labels), 0.0)
    at = sorted(cum.items())
    return [(le, c - (at[i - 1][1] if i else 0.0)) for i, (le, c) in enumerate(at)]


def median(hist: list[tuple[float, float]]) -> float:
    """Median by linear interpolation inside its bucket (seconds)."""
    total, acc, lo = sum(c for _, c in hist), 0.0, 0.0
    for le, c in hist:
        if c and acc + c >= total / 2:
            hi = le if math.isfinite(le) else lo * 2
            return lo + (hi - lo) * (total / 2 - acc) / c
        acc, lo = acc + c, le
    return float("nan")


def last_bucket(hist: list[tuple[float, float]]) -> float:
    return max((le for le, c in hist if c), default=0.0)


def matching(m: dict, name: str, labels: dict[str, str]) -> list[float]:
    """The samples of ``name`` whose labels include ``labels``."""
    return [v for (n, ls), v in m.items() if n == name and labels.items() <= dict(ls).items()]


def value(m: dict, name: str, **labels: str) -> float:
    return sum(matching(m, name, labels))


def top(m: dict, name: str, **labels: str) -> float:
    return max(matching(m, name, labels), default=0.0)


@dataclass
class Run:
    name: str
    passes: list[Outputs]
    errors: list[str]
    hist: dict[str, list[tuple[float, float]]]  # phase -> buckets (measured passes)
    decode_hist: dict[str, list[tuple[float, float]]]  # the same, decode steps only
    moving_max: float  # exact, from the gauge
    moving_decode_max: float
    rebalances: dict[str, float]  # result -> count
    history: list[admin_pb2.RebalanceOutcome]
    wall_s: float
    before: tuple[int, Slots]  # the live placement when the measured passes began
    # each stream that left the reference's greedy tokens: where, and both tokens' log-probs there
    diverged: list[str] = field(default_factory=list)


def run(args: argparse.Namespace, name: str, cmd: list[str], load: list[list[list[int]]], warm: bool,
        servers: list[Proc], out: Path, ref: Outputs | None = None) -> Run:  # fmt: skip
    """One coordinator's passes; with ``ref`` (run A's first pass), each of its streams that left
    ``ref``'s tokens is scored at its first difference on this coordinator (:func:`margins`)."""
    co = spawn(f"coordinator-{name}", cmd, _LISTEN, args.startup_timeout, out / f"coordinator-{name}.log")
    try:
        addr = f"127.0.0.1:{co.port}"
        wait_serving(addr, args.startup_timeout, [co, *servers])
        # untimed: run A's round lets the servers compile and capture every batch shape first;
        # otherwise one short request (fewer steps than --interval: no rebalance yet)
        first = load[:1] if warm else [load[0][:1]]
        _, errs = asyncio.run(serve(addr, first, args.new_tokens if warm else 2))
        m0 = scrape(co.http)
        with grpc.insecure_channel(addr) as ch:
            info = admin_pb2_grpc.AdminStub(ch).GetPlacement(admin_pb2.GetPlacementRequest(), timeout=30)
        t0 = time.perf_counter()
        passes = []
        for _ in range(args.passes):
            outs, e = asyncio.run(serve(addr, load, args.new_tokens))
            passes.append(outs)
            errs += e
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # a push still committing shows in the status
        m1 = scrape(co.http)
        with grpc.insecure_channel(addr) as ch:
            st = admin_pb2_grpc.AdminStub(ch).GetEplbStatus(admin_pb2.GetEplbStatusRequest(), timeout=30)
        if value(m0, "expertmesh_step_seconds_count", placement="moving"):
            errs.append("a push overlapped the warm-up: the moving steps' worst includes it")
        # NOTE: a failed rebalance, and one whose commit failed on a server (still "rebalanced"),
        # say why here; the table only counts them
        errs += [
            f"rebalance to generation {o.generation}: {o.outcome}: {o.error}" for o in st.history if o.error
        ]
        results = {
            dict(labels)["result"]: v for (n, labels), v in m1.items() if n == "expertmesh_rebalances_total"
        }
        diverged = asyncio.run(margins(addr, load, ref, passes)) if ref is not None else []
        return Run(
            name,
            passes,
            errs,
            {p: buckets(m0, m1, p) for p in ("steady", "moving")},
            {p: buckets(m0, m1, p, "decode") for p in ("steady", "moving")},
            top(m1, "expertmesh_step_seconds_max", placement="moving"),
            top(m1, "expertmesh_step_seconds_max", placement="moving", kind="decode"),
            results,
            [o for o in st.history if o.outcome == "rebalanced"],
            wall,
            (info.generation, slots_of_info(info)),
            diverged,
        )
    finally:
        co.stop()


async def margins(addr: str, load: list[list[list[int]]], ref: Outputs, passes: list[Outputs]) -> list[str]:
    """For each stream of ``passes`` whose greedy tokens left ``ref``'s: the first differing
    position and the log-probabilities there of ``ref``'s token and of this run's, both scored
    on the same prefix (the prompt and ``ref``'s tokens before it). A gap near zero is a near-tie
    that a change of summation order flips; a large one would be a wrong answer."""
    out = []
    async with AsyncClient(addr, timeout=600) as client:
        for n, got in enumerate(passes):
            for key in sorted(ref.keys() & got.keys()):
                a, b = ref[key], got[key]
                d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if d is None:
                    continue
                prefix = load[key[0]][key[1]] + a[:d]
                lp = []
                for tok in (a[d], b[d]):
                    c = await client.generate(
                        input_ids=[*prefix, tok], max_new_tokens=0, prompt_logprobs=True
                    )
                    lp.append(c.prompt_logprobs[-1])
                out.append(
                    f"pass {n + 1}, stream {key}: token {d}: run A's {a[d]} log-prob {lp[0]:.6f}, this run's "
                    f"{b[d]} {lp[1]:.6f} (gap {lp[0] - lp[1]:+.2e})"
                )
    return out


def slots_of_info(info: admin_pb2.PlacementInfo) -> Slots:
    out: Slots = {}
    for lp in info.layers:
        for i, name in enumerate(info.servers):
            held = sorted((s, e) for e, o, s in zip(lp.phy2log, lp.owner, lp.local_slot) if o == i)
            out[str(lp.layer), name] = [e for _, e in held]
    return out


def slots_of_json(text: str) -> Slots:
    raw = json.loads(text)
    return {(layer, name): list(v) for layer, lists in raw["layers"].items() for name, v in lists.items()}


def rewrites(old: Slots, new: Slots) -> tuple[int, int]:
    """(layer, server) tables whose slot count changes, and the slots that change (moved or
    read), by the worker's own move planner: what a commit writes where each table's allocation
    holds its new size (a table that outgrows it is built during prepare, or in the commit
    where the staging budget cannot hold it)."""
    resized = changed = 0
    for key, experts in new.items():
        plan = plan_layer(tuple(old.get(key, [])), tuple(experts))
        resized += plan.resize
        changed += len(plan.moves) + len(plan.reads)
    return resized, changed


# ---------------------------------------------------------------------- report


def compare(ref: Outputs, got: Outputs) -> str:
    keys = sorted(ref.keys() & got.keys())
    same = sum(ref[k] == got[k] for k in keys)
    firsts = [
        next(i for i, (a, b) in enumerate(zip(ref[k], got[k])) if a != b) for k in keys if ref[k] != got[k]
    ]
    tail = f" (first difference at token {min(firsts)})" if firsts else ""
    return f"{same}/{len(keys)}{tail}"


def report(args: argparse.Namespace, a: Run, b: Run, requests: int) -> str:
    ms = 1e3
    lines = [
        "| run | requests ok / failed | greedy equal to A pass 1 | steps (during a move) | median step ms | "
        "median during a move ms | worst steady ms (bucket bound) | worst during a move ms | "
        "worst during a move / median | decode steps: median ms, worst during a move ms, ratio | "
        "rebalances that moved weights (skipped, failed) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in (a, b):
        both = [(le, c + m) for (le, c), (_, m) in zip(r.hist["steady"], r.hist["moving"])]
        n_moving = sum(c for _, c in r.hist["moving"])
        med = median(both)
        ok = sum(len(p) for p in r.passes)
        equal = ", ".join(
            f"pass {i + 1}: {compare(a.passes[0], p)}" for i, p in enumerate(r.passes) if r is b or i > 0
        )
        worst = f"{r.moving_max * ms:.1f}" if n_moving else "-"
        med_moving = f"{median(r.hist['moving']) * ms:.1f}" if n_moving else "-"
        ratio = f"{r.moving_max / med:.2f}x" if n_moving else "-"
        dec = [(le, c + m) for (le, c), (_, m) in zip(r.decode_hist["steady"], r.decode_hist["moving"])]
        med_dec = median(dec)
        dec_moving = sum(c for _, c in r.decode_hist["moving"])
        decode = f"{med_dec * ms:.1f}, " + (
            f"{r.moving_decode_max * ms:.1f}, {r.moving_decode_max / med_dec:.2f}x" if dec_moving else "-, -"
        )
        moved = (
            f"{int(r.rebalances.get('rebalanced', 0))} ({int(r.rebalances.get('skipped', 0))}, "
            f"{int(r.rebalances.get('failed', 0))})"
        )
        lines.append(
            f"| {r.name} | {ok} / {requests - ok} | {equal or '-'} | {int(sum(c for _, c in both))} "
            f"({int(n_moving)}) | {med * ms:.1f} | {med_moving} | {last_bucket(r.hist['steady']) * ms:.1f} | "
            f"{worst} | {ratio} | {decode} | {moved} |"
        )
    if b.diverged:
        lines += [
            "",
            f"Streams of run {b.name} that left run A's greedy tokens, scored on run {b.name}'s coordinator:",
            "",
        ]
        lines += [f"- {d}" for d in b.diverged]
    gen, live = b.before
    lines += [
        "",
        f"| rebalance (run B) | weights moved | MiB | (layer, server) tables resized (of {len(live)}) | "
        "slots changed | prepare ms | commit ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for o in sorted(b.history, key=lambda o: o.generation):
        new = slots_of_json(o.placement_json)
        # NOTE: the status keeps the last 16 outcomes: an earlier one missing, the tables before are unknown
        resized, written = map(str, rewrites(live, new)) if o.generation == gen + 1 else ("?", "?")
        gen, live = o.generation, new
        lines.append(
            f"| generation {o.generation} | {o.weights_moved} | {o.bytes_moved / 2**20:.0f} | {resized} | "
            f"{written} | {o.prepare_ms:.0f} | {o.commit_ms:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--device", default="cpu", help="the coordinator's")
    p.add_argument("--gpu-device", default="cpu", help="the gpu-server's (cpu: the plain torch backend)")
    p.add_argument("--second", choices=["cpu", "gpu"], default="cpu", help="the second expert server")
    p.add_argument("--second-device", default="cpu", help="with --second gpu (it preloads the upper half)")
    p.add_argument(
        "--gpu-experts", type=int, default=None, help="initially on the GPU server (default: half)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--coordinator-threads", type=int, default=1)
    p.add_argument("--kv-memory", default="256MiB")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="rounds of --concurrency requests per pass")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--interval", type=int, default=8, help="run B: EPLB every N steps")
    p.add_argument("--window", type=int, default=16, help="run B: the load window, steps")
    p.add_argument("--redundant", type=int, default=2, help="run B: replica slots per server")
    p.add_argument(
        "--max-moves",
        type=int,
        default=0,
        help="run B: --eplb-max-moves (expert weights per rebalance, 0 = no cap)",
    )
    p.add_argument(
        "--max-move-mb",
        type=int,
        default=1024,
        help="run B: --eplb-max-move-mb (MiB of expert weights per rebalance, 0 = no cap; the coordinator's default)",
    )
    p.add_argument(
        "--time-model",
        default="affine",
        help="run B: --eplb-time-model; a comma list runs B once per model against the same run A",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--server-flags",
        default="",
        help="extra flags for both expert servers, one string (e.g. a --placement-staging-mb "
        "large enough to read every moved expert ahead of the commit)",
    )
    p.add_argument("--out", default=None, help="logs and the table (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if args.model is None:
            from expertmesh.demo import write_demo_model

            model = write_demo_model(Path(tmp) / "demo-model")
        else:
            model = Path(args.model)
        cfg = ModelConfig.from_dir(model)
        if args.gpu_experts is None:
            args.gpu_experts = cfg.num_experts // 2
        load = prompts(args, cfg.vocab_size)
        t0 = time.perf_counter()
        servers = start_servers(args, model, cfg, out)
        started = time.perf_counter() - t0
        try:
            cmd = coordinator_cmd(args, model, servers)
            a = run(args, "A", cmd, load, True, servers, out)
            bs = []
            for tm in args.time_model.split(","):
                name = "B" if "," not in args.time_model else f"B-{tm}"
                bs.append(
                    run(args, name, [*cmd, *eplb_flags(args, tm)], load, False, servers, out, a.passes[0])
                )
        finally:
            for s in servers:
                s.stop()
        requests = args.passes * args.rounds * args.concurrency
        head = (
            f"## {model.name}: {cfg.num_experts} experts x {len(cfg.moe_layer_ids)} MoE layers, "
            f"{args.dtype}; coordinator on {args.device}, gpu-server on {args.gpu_device} + "
            f"{args.second}-server ({args.gpu_experts if args.second == 'cpu' else cfg.num_experts // 2} "
            "experts on the first GPU server at first); "
            f"{args.passes} passes x {args.rounds} rounds x {args.concurrency} concurrent streams x "
            f"{args.new_tokens} tokens; run B: EPLB every {args.interval} steps, window {args.window}, "
            f"{args.redundant} redundant slots per server, time model {args.time_model}"
            + (f", at most {args.max_moves} weights moved per rebalance" if args.max_moves else "")
            + (
                f", at most {args.max_move_mb} MiB moved per rebalance"
                if args.max_move_mb
                else ", no MiB cap"
            )
            + (f"; expert servers with `{args.server_flags}`" if args.server_flags else "")
            + "\n"
        )
        text = head + "\n" + "\n\n".join(report(args, a, b, requests) for b in bs)
        text += (
            f"\n\nservers up in {started:.0f} s; "
            + ", ".join(f"run {r.name} {r.wall_s:.1f} s" for r in (a, *bs))
            + " (measured passes)"
        )
        for r in (a, *bs):
            text += "".join(f"\n- run {r.name}: {e}" for e in r.errors[:10])
        print(text)
        (out / "bench_rebalance.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
