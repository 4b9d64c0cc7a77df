"""Full-size serving topologies through the real CLI processes: load time, decode speed, memory.

Writes a random checkpoint from a published config.json (Qwen3-30B-A3B by default,
DeepSeek-V2-Lite with ``--model deepseek-v2-lite``) in HF's per-expert tensor names (bf16; every
tensor tiled from a few random blocks per fan-in: the bytes moved, which the timings depend on,
are those of the real model; the numbers computed are noise), then for each topology starts the
processes ``expertmesh`` users start, waits for health SERVING and measures through a streaming
gRPC client:

- ``load_s``: coordinator start -> SERVING (a CPU server reused from the row before is already
  up; its own start is its row's ``server_load_s``), and ``start_s``: when each phase of the
  coordinator's start ended, from its log (its weights read, its own experts read, the KV
  cache, listening, the expert servers ready);
- TPOT p50 at batch 1 and batch 8 (``--prompt`` tokens of prompt, ``--new-tokens`` generated,
  ``ignore_eos``; one warm-up request first), and tokens/s = batch / TPOT;
- GPU memory per process (nvidia-smi) and resident memory of every process;
- with ``--py-spy S``: py-spy samples (raw, every thread, idle included) of each process of the
  row for S seconds of its first batch's timed stream, ``spy-ROW-PROCESS.txt`` in ``--out``;
- the per-layer split where measurable: the coordinator's mean per-member round trip per
  MoE layer (expertmesh_expert_layer_round_trip_seconds: ``local`` is its launch on the GPU's
  stream, a CPU server's its whole answer) and the CPU server's own compute per layer
  (expertmesh_worker_layer_compute_seconds).

Topologies (``--rows``; order matters: the CPU server of consecutive rows with the same weight
dtype is reused, and each row's CPU share is a subset of the row before, so nothing is re-read):

- ``inproc``: ``coordinator --device DEV`` with no expert server (the baseline);
  ``inproc_noahead``: the same with ``--no-compile-ahead`` (its kernels compiled in its own
  process, not by the helper that starts with it; see ``--fresh-kernel-cache``);
- ``cpu_int4``: every expert on ``cpu-server --weight-dtype int4``;
- ``local25_int4`` / ``local50_int4`` / ``local75_int4``: ``--num-gpu-experts`` = 25/50/75% in
  the coordinator's process (``local``), the rest on that CPU server;
- ``cpu_bf16``, ``local25_bf16`` ...: the same with bf16 CPU experts;
- ``cpu_int4row``, ``local50_int4row`` ...: int4 with one scale per row (``--weight-group row``);
- ``..._nolink`` (e.g. ``cpu_int4_nolink``): the same with the CPU server refusing the host link
  (``EXPERTMESH_LINK=0``): the piecewise path, the baseline of the linked rows;
- ``gpusrv50_int4``: half on a ``gpu-server`` on the coordinator's GPU (the older hybrid);
- ``remote_T[_dUS][_mbN]``: every expert on a ``gpu-server`` on ``--remote-device`` (another GPU
  standing in for another machine) over ``--transport T`` (grpc, tcp, shm, auto); ``_dUS``: the
  TCP data path through the loopback delay proxy adding US microseconds each way
  (``--server-data-address``; ``_d0``: the proxy's own cost; ``--proxy-impl``: its C or Python
  data path); ``_mbN``: ``--micro-batches N`` (``_mb1``: whole steps; no suffix: the
  coordinator's default, ``auto``);
- ``up``: ``expertmesh up --model DIR`` with its defaults.

Tiny run anywhere (CPU; proves the script)::

    python benchmarks/bench_fullsize.py --device cpu --layers 2 --experts 8 --hidden 256 --tiny-attention \\
        --rows inproc,cpu_int4,local50_int4,local50_bf16,up --new-tokens 8 --out /tmp/fs

On a 2-GPU host with 32 cores (see benchmarks/RESULTS.md for the exact device command)::

    python benchmarks/bench_fullsize.py --device cuda:0 --threads 28 --ckpt-dir /tmp/q3 --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.fullsize_ckpt import CONFIGS, tiny_overrides, write_checkpoint  # noqa: E402
from expertmesh import health  # noqa: E402
from expertmesh.client import AsyncClient  # noqa: E402

_LISTEN = re.compile(r"listening on (\S+):(\d+)")
_UP = re.compile(r"expertmesh is serving on (\S+):(\d+)")
_DATA = re.compile(r"TCP data path on (\S+):(\d+)")
_PROXY = re.compile(r"delay proxy listening on (\S+):(\d+)")
_HTTP = re.compile(r"(?:HTTP API and /metrics|Prometheus metrics) on https?://\S+:(\d+)")
# the coordinator's start, phase by phase: the log line that ends each phase (its first one)
_START = (
    ("weights", re.compile(r"coordinator weights: .*done in")),
    ("experts", re.compile(r"(?:coordinator|local) experts: .*done in")),
    ("helper", re.compile(r"kernel compile helper: the decode buckets")),
    ("kv", re.compile(r"KV cache: ")),
    ("listening", re.compile(r"coordinator listening on ")),
    ("ready", re.compile(r"expert servers ready")),
)
ROWS = "inproc,cpu_int4,local25_int4,local50_int4,local75_int4,cpu_bf16,local25_bf16,local50_bf16,local75_bf16,up"


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # time.monotonic() each line arrived
    port: int = 0
    http: int = 0

    def rss_gib(self) -> float:
        """Resident memory of the process and its children (``up`` starts the others)."""
        total = 0
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            try:
                m = re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
                total += int(m.group(1)) if m else 0
            except OSError:
                pass
        return total / (1 << 20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def cpu_seconds(procs: list[Proc]) -> dict[str, float]:
    """CPU time (user + system) each process and its children have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in procs:
        total = 0
        for pid in [p.proc.pid, *_children(p.proc.pid)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
            except (OSError, IndexError, ValueError):
                pass
        out[p.name] = total / tick
    return out


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(k) for k in kids]
    return out + [g for k in out for g in _children(k)]


def spawn(
    name: str, cmd: list[str], pattern: re.Pattern, timeout: float, log: Path, env: dict | None = None
) -> Proc:
    """Starts ``cmd`` (its output to ``log`` and kept; ``env``: extra variables), waits for ``pattern``."""
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = Proc(
        name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    )
    found = threading.Event()

    def drain() -> None:
        assert p.proc.stdout is not None
        with log.open("a") as f:
            for line in p.proc.stdout:
                f.write(line)
                p.stamps.append(time.monotonic())
                p.lines.append(line)
                h = _HTTP.search(line)
                if h and not p.http:
                    p.http = int(h.group(1))
                m = pattern.search(line)
                if m and not p.port:
                    p.port = int(m.group(2))
                    found.set()
        found.set()

    threading.Thread(target=drain, daemon=True).start()
    if not found.wait(timeout) or not p.port:
        p.stop()
        raise RuntimeError(f"{name} did not start within {timeout:g}s:\n{''.join(p.lines[-30:])}")
    return p


def start_split(p: Proc, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` (the spawn) to the end of each phase of a coordinator's start that its
    log shows (``_START``; a phase the topology lacks is left out)."""
    out = {}
    for name, pattern in _START:
        at = next((t for t, ln in zip(p.stamps, p.lines) if pattern.search(ln)), None)
        if at is not None:
            out[name] = round(at - t0, 1)
    return out


def wait_serving(addr: str, timeout: float, procs: list[Proc]) -> float:
    t0 = time.monotonic()
    while health.check(addr, 1.0) != "SERVING":
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited:\n{''.join(p.lines[-30:])}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{addr} not SERVING after {timeout:g}s")
        time.sleep(0.2)
    return time.monotonic() - t0


# ---------------------------------------------------------------------- measuring


async def _stream(client: AsyncClient, ids: list[int], n: int) -> list[float]:
    """Per generated token after the first: seconds since the token before."""
    gaps: list[float] = []
    last = None
    async for chunk in client.stream(input_ids=ids, max_new_tokens=n, ignore_eos=True):
        now = time.perf_counter()
        k = len(chunk.token_ids)
        if last is not None and k:
            gaps += [(now - last) / k] * k
        last = now
    return gaps


async def tpot(addr: str, batch: int, prompt: int, new_tokens: int, vocab: int) -> float:
    """TPOT p50 (seconds) of ``batch`` concurrent streams, after a warm-up of the same batch."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab - 10, (prompt,), generator=g).tolist() for _ in range(batch)]
    async with AsyncClient(addr, timeout=1200) as c:
        await asyncio.gather(*(_stream(c, p, 4) for p in prompts))
        runs = await asyncio.gather(*(_stream(c, p, new_tokens) for p in prompts))
    gaps = [x for r in runs for x in r]
    return statistics.median(gaps) if gaps else float("nan")


def scrape(port: int) -> dict[str, tuple[float, float]]:
    """{metric{labels}: (sum, count)} of the histograms at ``port``'s /metrics."""
    if not port:
        return {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + (m.group(3) or "")
            out.setdefault(key, [0.0, 0.0])[0 if m.group(2) == "sum" else 1] += float(m.group(4))
    return {k: (s, c) for k, (s, c) in out.items()}


_LINK = ("layers", "kernel_seconds", "wait_seconds")  # the CPU server's host-link counters


def counter(port: int, name: str) -> float:
    """The value of counter ``name`` at ``port``'s /metrics (0 when absent)."""
    if not port:
        return 0.0
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0
    m = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def per_layer_ms(before: dict, after: dict, prefix: str) -> dict[str, float]:
    """Mean ms per observation of each histogram named ``prefix`` between two scrapes."""
    out = {}
    for key, (s, c) in after.items():
        if key.startswith(prefix):
            s0, c0 = before.get(key, (0.0, 0.0))
            if c > c0:
                label = re.search(r'(?:server|layer)="([^"]*)"', key)
                out[label.group(1) if label else key] = round((s - s0) / (c - c0) * 1e3, 3)
    return out


def gpu_mib() -> dict[int, int]:
    """Used GPU memory per process id (nvidia-smi; empty without it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    res = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            res[int(parts[0])] = int(parts[1])
    return res


# ---------------------------------------------------------------------- topologies


@dataclass
class Row:
    name: str
    server_dtype: str | None  # the CPU server's --weight-dtype (None: no CPU server)
    gpu_share: float  # experts in process (or on the GPU server) / all
    gpu_server: bool = False
    up: bool = False
    transport: str = ""  # remote rows: every expert on a gpu-server on --remote-device over this
    # remote rows: the data path through the delay proxy adding this much each way (None: no
    # proxy; 0: the proxy's own cost, to set beside the direct row)
    delay_us: int | None = None
    micro_batches: int = 0
    link: bool = True  # the CPU server takes the host link (a ``_nolink`` row: EXPERTMESH_LINK=0)
    compile_ahead: bool = True  # the coordinator's default (an ``_noahead`` row: --no-compile-ahead)


def parse_row(name: str) -> Row:
    if name in ("inproc", "inproc_noahead"):
        return Row(name, None, 1.0, compile_ahead=name == "inproc")
    if name == "up":
        return Row(name, None, 1.0, up=True)
    r = re.fullmatch(r"remote_(grpc|tcp|shm|auto)(?:_d(\d+))?(?:_mb(\d+))?", name)
    if r:
        if r.group(2) and r.group(1) != "tcp":
            raise SystemExit(f"row {name!r}: the delay proxy sits on the TCP data path only")
        return Row(name, None, 1.0, True, transport=r.group(1), delay_us=None if r.group(2) is None else int(r.group(2)),
                   micro_batches=int(r.group(3) or 0))  # fmt: skip
    m = re.fullmatch(r"(cpu|local(\d+)|gpusrv(\d+))_(int4row|int4|int8|bf16)(_nolink)?", name)
    if not m:
        raise SystemExit(f"unknown row {name!r}")
    share = 0.0 if m.group(1) == "cpu" else int(m.group(2) or m.group(3)) / 100
    return Row(name, m.group(4), share, gpu_server=m.group(3) is not None, link=m.group(5) is None)


class Bench:
    def __init__(self, args: argparse.Namespace, ckpt: Path, cfg: dict) -> None:
        self.args, self.ckpt, self.cfg = args, ckpt, cfg
        self.cli = [sys.executable, "-m", "expertmesh.cli"]
        self.log = Path(args.out) / "logs.txt"
        self.cpu: Proc | None = None
        self.cpu_dtype: tuple[str, bool] | None = None  # (weight dtype, host link on)
        self.cpu_load_s = 0.0

    def kernel_cache(self, row: Row) -> dict | None:
        """With ``--fresh-kernel-cache``: an empty Triton cache directory for ``row``'s coordinator."""
        if not self.args.fresh_kernel_cache:
            return None
        d = Path(self.args.out) / "triton-cache" / row.name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return {"TRITON_CACHE_DIR": str(d)}

    def cpu_server(self, dtype: str, link: bool = True) -> tuple[Proc, float]:
        """The CPU server with ``dtype`` experts, taking the host link or not (reused while
        consecutive rows share both)."""
        if self.cpu is not None and self.cpu_dtype == (dtype, link) and self.cpu.proc.poll() is None:
            return self.cpu, 0.0
        if self.cpu is not None:
            self.cpu.stop()
        a = self.args
        cmd = [*self.cli, "cpu-server", "--model", str(self.ckpt), "--port", "0", "--dtype", "bfloat16",
               "--metrics-port", "0", "--threads", str(a.threads)]  # fmt: skip
        if dtype == "int4row":
            cmd += ["--weight-dtype", "int4", "--weight-group", "row"]
        elif dtype != "bf16":
            cmd += ["--weight-dtype", dtype]
        t0 = time.monotonic()
        env = None if link else {"EXPERTMESH_LINK": "0"}
        self.cpu = spawn(f"cpu-server {dtype}", cmd, _LISTEN, a.startup_timeout, self.log, env)
        wait_serving(f"127.0.0.1:{self.cpu.port}", a.startup_timeout, [self.cpu])
        self.cpu_dtype = (dtype, link)
        self.cpu_load_s = time.monotonic() - t0
        return self.cpu, self.cpu_load_s

    def spy(self, row: Row, procs: list[Proc]) -> list:
        """With ``--py-spy S``: a thread per process that waits a second (the warm-up request)
        and records S seconds of py-spy samples into ``--out``."""
        import threading

        s = self.args.py_spy
        if s <= 0:
            return []
        exe = shutil.which("py-spy")
        if exe is None:
            raise RuntimeError("--py-spy: py-spy is not on PATH")

        def record(p: Proc) -> None:
            time.sleep(1.0)
            name = re.sub(r"[^\w.-]+", "_", p.name)
            dest = Path(self.args.out) / f"spy-{row.name}-{name}.txt"
            cmd = [exe, "record", "--rate", "250", "--idle", "--threads", "--nonblocking", "--format", "raw",
                   "-d", str(max(1, round(s))), "-p", str(p.proc.pid), "-o", str(dest)]  # fmt: skip
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=s + 60)

        spies = [threading.Thread(target=record, args=(p,), daemon=True) for p in procs]
        for t in spies:
            t.start()
        return spies

    def run_row(self, row: Row) -> dict:
        a, e = self.args, self.cfg["experts"]
        res: dict = {"row": row.name}
        procs: list[Proc] = []
        extra: list[Proc] = []
        if row.server_dtype is None:  # NOTE: a CPU server kept for later rows would hold cores and memory
            self.close()
        try:
            if row.up:
                cmd = [*self.cli, "up", "--model", str(self.ckpt), "--port", "0"]
                t0 = time.monotonic()
                co = spawn("up", cmd, _UP, a.startup_timeout, self.log)
                res["load_s"] = round(time.monotonic() - t0, 1)
                res["topology"] = next((ln.strip() for ln in co.lines if "expertmesh up:" in ln), "")
                procs.append(co)
            else:
                flags = ["--device", a.device, "--dtype", "bfloat16", "--kv-memory", a.kv_memory,
                         "--threads", str(a.coordinator_threads), "--http-port", "0"]  # fmt: skip
                n = round(row.gpu_share * e)
                if row.server_dtype is not None:
                    cpu, res["server_load_s"] = self.cpu_server(row.server_dtype, row.link)
                    res["server_load_s"] = round(res["server_load_s"], 1)
                    flags += ["--cpu-server", f"127.0.0.1:{cpu.port}", "--num-gpu-experts", str(n)]
                    extra.append(cpu)
                if row.gpu_server:
                    dev = a.remote_device if row.transport else a.device
                    gcmd = [*self.cli, "gpu-server", "--model", str(self.ckpt), "--port", "0", "--dtype",
                            "bfloat16", "--device", dev, "--experts", f"0-{n - 1}", "--metrics-port", "0"]  # fmt: skip
                    gpu = spawn("gpu-server", gcmd, _LISTEN, a.startup_timeout, self.log)
                    procs.append(gpu)
                    t0 = time.monotonic()
                    wait_serving(f"127.0.0.1:{gpu.port}", a.startup_timeout, [gpu])
                    res["server_load_s"] = round(time.monotonic() - t0, 1)
                    flags += ["--gpu-server", f"127.0.0.1:{gpu.port}"]
                if not row.compile_ahead:
                    flags += ["--no-compile-ahead"]
                if row.transport:
                    flags += ["--transport", row.transport]
                if row.micro_batches:
                    flags += ["--micro-batches", str(row.micro_batches)]
                if row.delay_us is not None:
                    data = next((m for ln in gpu.lines if (m := _DATA.search(ln))), None)
                    if data is None:
                        raise RuntimeError("the gpu-server printed no TCP data port")
                    pcmd = [sys.executable, "-m", "expertmesh.transport.delay_proxy", "--listen", "127.0.0.1:0",
                            "--to", f"127.0.0.1:{data.group(2)}", "--delay-us", str(row.delay_us),
                            "--impl", a.proxy_impl]  # fmt: skip
                    proxy = spawn("delay-proxy", pcmd, _PROXY, a.startup_timeout, self.log)
                    procs.append(proxy)
                    flags += ["--server-data-address", f"gpu0=127.0.0.1:{proxy.port}"]
                t0 = time.monotonic()
                co = spawn("coordinator", [*self.cli, "coordinator", "--model", str(self.ckpt), "--port", "0",
                                           *flags], re.compile(r"coordinator listening on (\S+):(\d+)"),
                           a.startup_timeout, self.log, self.kernel_cache(row))  # fmt: skip
                procs.append(co)
                wait_serving(f"127.0.0.1:{co.port}", a.startup_timeout, [co, *extra])
                res["load_s"] = round(time.monotonic() - t0, 1)
                res["start_s"] = start_split(co, t0)
            addr = f"127.0.0.1:{co.port}"
            if row.up:
                wait_serving(addr, a.startup_timeout, procs)
            # the expert server whose own compute per layer is read: the CPU server, else the GPU one
            srv_http = (
                self.cpu.http
                if extra and self.cpu
                else next((p.http for p in procs if p.name == "gpu-server"), 0)
            )
            for b in a.batches:
                m0 = scrape(co.http), scrape(srv_http)
                linked0 = counter(co.http, "expertmesh_linked_decode_steps_total")
                split0 = counter(co.http, "expertmesh_linked_micro_batched_steps_total")
                queued0 = counter(co.http, "expertmesh_queued_decode_steps_total")
                link0 = {k: counter(srv_http, f"expertmesh_worker_link_{k}_total") for k in _LINK}
                c0, w0 = cpu_seconds([*procs, *extra]), time.monotonic()
                spies = self.spy(row, [*procs, *extra]) if b == a.batches[0] else []
                t = asyncio.run(tpot(addr, b, a.prompt, a.new_tokens, self.cfg["vocab"]))
                for spy in spies:
                    spy.join()
                c1, w1 = cpu_seconds([*procs, *extra]), time.monotonic()
                m1 = scrape(co.http), scrape(srv_http)
                # cores each process kept busy while measured (a busy neighbour shows here)
                res[f"cores_b{b}"] = {k: round((c1[k] - c0.get(k, 0.0)) / (w1 - w0), 1) for k in c1}
                res[f"linked_steps_b{b}"] = counter(co.http, "expertmesh_linked_decode_steps_total") - linked0
                res[f"split_steps_b{b}"] = (
                    counter(co.http, "expertmesh_linked_micro_batched_steps_total") - split0
                )
                # decode steps launched behind the running one (the scheduler's queue)
                res[f"queued_steps_b{b}"] = counter(co.http, "expertmesh_queued_decode_steps_total") - queued0
                link = {k: counter(srv_http, f"expertmesh_worker_link_{k}_total") - link0[k] for k in _LINK}
                if link["layers"]:  # the CPU server's C thread per linked layer: kernel, spin
                    res[f"link_kernel_ms_b{b}"] = round(link["kernel_seconds"] / link["layers"] * 1e3, 3)
                    res[f"link_wait_ms_b{b}"] = round(link["wait_seconds"] / link["layers"] * 1e3, 3)
                res[f"tpot_ms_b{b}"] = round(t * 1e3, 2)
                res[f"tok_s_b{b}"] = round(b / t, 1)
                res[f"round_trip_ms_b{b}"] = per_layer_ms(m0[0], m1[0], "expertmesh_expert_layer_round_trip")
                cpu_ms = per_layer_ms(m0[1], m1[1], "expertmesh_worker_layer_compute")
                if cpu_ms:
                    res[f"server_compute_ms_b{b}"] = round(statistics.mean(cpu_ms.values()), 3)
            mem = gpu_mib()
            res["gpu_mib"] = {p.name: sum(mem.get(pid, 0) for pid in [p.proc.pid, *_children(p.proc.pid)])
                              for p in [*procs, *extra]} if mem else {}  # fmt: skip
            res["rss_gib"] = {p.name: round(p.rss_gib(), 1) for p in [*procs, *extra]}
        except Exception as err:  # noqa: BLE001 - a failed row is reported, the next rows still run
            res["error"] = f"{type(err).__name__}: {err}"[-2000:]
        finally:
            for p in reversed(procs):
                p.stop()
        return res

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.stop()
        self.cpu = self.cpu_dtype = None


def table(results: list[dict], batches: list[int]) -> str:
    head = ["row", "load s", *(f"tok/s b{b}" for b in batches), *(f"TPOT ms b{b}" for b in batches),
            "linked steps", "GPU MiB", "RSS GiB", "per-layer round trip ms (b1)", "server compute ms/layer (b1)",
            "host link kernel / spin ms per layer (b1)", "busy cores (b1)",
            "coordinator start: s from spawn to each phase's end"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error'].splitlines()[-1][:120]} |")
            continue
        load = f"{r['load_s']}" + (f" (+{r['server_load_s']} server)" if r.get("server_load_s") else "")
        cells = [r["row"], load, *(str(r.get(f"tok_s_b{b}")) for b in batches),
                 *(str(r.get(f"tpot_ms_b{b}")) for b in batches),
                 " / ".join(str(int(r.get(f"linked_steps_b{b}", 0))) for b in batches)
                 + (" (split " + " / ".join(str(int(r.get(f"split_steps_b{b}", 0))) for b in batches) + ")"
                    if any(r.get(f"split_steps_b{b}") for b in batches) else ""),
                 ", ".join(f"{k} {v}" for k, v in r["gpu_mib"].items()) or "n/a",
                 ", ".join(f"{k} {v}" for k, v in r["rss_gib"].items()),
                 ", ".join(f"{k} {v}" for k, v in r.get(f"round_trip_ms_b{batches[0]}", {}).items()) or "-",
                 str(r.get(f"server_compute_ms_b{batches[0]}", "-")),
                 f"{r[f'link_kernel_ms_b{batches[0]}']} / {r[f'link_wait_ms_b{batches[0]}']}"
                 if f"link_kernel_ms_b{batches[0]}" in r else "-",
                 ", ".join(f"{k} {v}" for k, v in r.get(f"cores_b{batches[0]}", {}).items()) or "-",
                 ", ".join(f"{k} {v}" for k, v in r.get("start_s", {}).items()) or "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(CONFIGS))
    p.add_argument("--ckpt-dir", default=None, help="where the checkpoint is written (kept and reused)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 8) - 4), help="CPU server")
    p.add_argument("--coordinator-threads", type=int, default=4)
    p.add_argument(
        "--remote-device",
        default="cuda:1"
        if torch.cuda.device_count() > 1
        else ("cuda:0" if torch.cuda.is_available() else "cpu"),
        help="the gpu-server of the remote_* rows (another GPU stands in for another machine)",
    )
    p.add_argument("--rows", default=ROWS)
    p.add_argument(
        "--proxy-impl", default="auto", choices=("auto", "c", "python"), help="the _dUS rows' delay proxy"
    )
    p.add_argument("--batches", default="1,8")
    p.add_argument(
        "--fresh-kernel-cache",
        action="store_true",
        help="each row's coordinator starts with an empty Triton cache of its own (a machine that "
        "never compiled the kernels), whatever ran before it",
    )
    p.add_argument(
        "--py-spy",
        type=float,
        default=0.0,
        metavar="S",
        help="sample every process of a row with py-spy for S seconds of its first batch's timed "
        "stream (py-spy on PATH)",
    )
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-memory", default="2GiB")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--experts", type=int, default=None, help="override the routed experts")
    p.add_argument("--hidden", type=int, default=None, help="override hidden_size")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--tiny-attention", action="store_true", help="a few small heads, a small vocab and MLPs")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    over = {k: v for k, v in (("num_hidden_layers", args.layers), ("experts", args.experts),
                              ("hidden_size", args.hidden), ("top_k", args.top_k)) if v is not None}  # fmt: skip
    if args.tiny_attention:
        over = {**tiny_overrides(args.model), **over}
    ckpt = Path(args.ckpt_dir or out / "ckpt")
    t0 = time.monotonic()
    cfg, wrote = write_checkpoint(args.model, ckpt, over, args.device)
    print(f"checkpoint {ckpt}: {'written' if wrote else 'reused'} in {time.monotonic() - t0:.0f}s "
          f"({cfg['bytes'] / 1e9:.1f} GB)", flush=True)  # fmt: skip
    bench = Bench(args, ckpt, cfg)
    results = []
    try:
        for name in args.rows.split(","):
            r = bench.run_row(parse_row(name))
            print(json.dumps(r), flush=True)
            results.append(r)
            (out / "results.json").write_text(
                json.dumps({"config": cfg, "args": vars(args), "rows": results})
            )
    finally:
        bench.close()
    md = table(results, args.batches)
    (out / "table.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
