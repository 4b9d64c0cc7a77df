"""``expertmesh up``: a whole cluster on this machine, as child processes.

The topology comes from expertmesh/topology.py and is printed first. With a GPU: a coordinator
on it in the checkpoint's dtype holding every expert that fits in its own process, and a CPU
expert server for the rest only when some do not fit (or ``--num-gpu-experts`` says so).
Without a GPU (or with ``--coordinator-device cpu``): a GPU expert server (experts
``< --num-gpu-experts``), a CPU expert server (the rest) and a coordinator connected to both.
It waits until the coordinator's health is SERVING (echoing the children's loading progress),
prints ``expertmesh is serving on HOST:PORT`` and runs until Ctrl-C or SIGTERM, then stops the
coordinator first and the expert servers after it.

Children run in their own session (a terminal's Ctrl-C reaches only this process, which stops
them in order) and get SIGTERM from the kernel if this process dies (PR_SET_PDEATHSIG). If a
child exits while starting or serving, the others are stopped, the tail of its output is
printed and the exit status is non-zero. With ``--prompt``, it prints one completion once
serving and then stops everything (``make demo``).

Each child's output goes to ``NAME.log`` in ``--log-dir`` (default: a fresh directory under the
temporary directory), which the banner names; ``--verbose`` also echoes it to stderr. The
coordinator's flags that make sense for a local cluster (LoRA, EPLB, scheduling limits) are
``up``'s own and passed on when given; any other flag reaches a child through
``--coordinator-args``, ``--gpu-server-args`` or ``--cpu-server-args`` (one shell-quoted string
each, after ``up``'s own flags so that it wins over them).

The cluster is closed to other local users' placement pushes: the children share a cluster
token (``EXPERTMESH_CLUSTER_TOKEN`` if set, else a fresh random one) given to them through their
environment, not their command lines (which ``ps`` shows every user). The coordinator binds
loopback by default, where its Admin service needs no admin token.

With ``--tls-cert/--tls-key`` (and usually ``--tls-ca``; the same flags and ``EXPERTMESH_TLS_*``
variables as the other commands, expertmesh/tls.py) every hop is TLS: both expert servers serve
that certificate and, given the CA, require a client certificate from it; the coordinator
serves it on its public port (and HTTPS) and presents it to the expert servers. One certificate
for the three processes, so it must name 127.0.0.1 (or ``--tls-server-name``'s name) and allow
both server and client authentication. This process's own health checks and ``--prompt`` are
TLS clients that trust ``--tls-ca``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from expertmesh import auth, cores, topology
from expertmesh.tls import TLSConfig
from expertmesh.topology import Topology

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
# the coordinator's HTTP port and the expert servers' metrics ports
_HTTP = re.compile(r"(?:HTTP API and /metrics|Prometheus metrics) on https?://\S+:(\d+)")
_PR_SET_PDEATHSIG = 1
_PROGRESS = re.compile(r" expertmesh\.load ")  # expertmesh/progress.py's log lines


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        return None


_LIBC = _libc()  # loaded here: the child between fork and exec must not dlopen


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class Child:
    """A child process whose merged stdout/stderr is drained by a thread (tail kept)."""

    name: str
    cmd: list[str]
    echo: bool = False
    proc: subprocess.Popen = field(init=False)
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    port: int | None = None
    listening: threading.Event = field(default_factory=threading.Event)
    http_port: int | None = None  # the coordinator's HTTP API; an expert server's /metrics
    env: dict[str, str] | None = None  # None: this process's environment
    log: Path | None = None  # where its whole output goes (None: only the tail is kept)

    def start(self) -> None:
        env = dict(self.env if self.env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        out: IO[str] | None = self.log.open("w", encoding="utf-8") if self.log is not None else None
        try:
            self._read(self.proc.stdout, out)
        finally:
            if out is not None:
                out.close()
        self.listening.set()  # EOF: wake whoever waits for the port

    def _read(self, lines: IO[str], out: IO[str] | None) -> None:
        for line in lines:
            self.tail.append(line)
            if out is not None:
                out.write(line)
                out.flush()
            if self.echo or _PROGRESS.search(line):  # loading progress: a big model takes minutes
                sys.stderr.write(f"[{self.name}] {line}")
            h = _HTTP.search(line)
            if h:
                self.http_port = int(h.group(1))
            m = _LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(2))
                self.listening.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def report(self) -> str:
        where = f" (all of it: {self.log})" if self.log is not None else ""
        head = f"{self.name} exited with status {self.proc.returncode}; its last output{where}:\n"
        return head + "".join(self.tail)

    def stop(self, timeout: float) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# the coordinator's flags ``up`` takes itself: (flag, type, help); passed on only when given
_COORDINATOR_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--max-loras", int, "MoE LoRA adapters loaded at once"),
    ("--eplb-interval-steps", int, "EPLB: rebalance every N steps (0 = off)"),
    ("--eplb-window-steps", int, "EPLB: balance the load of the last W steps"),
    ("--eplb-redundant-slots", int, "EPLB: extra slots per server for replicas"),
    ("--eplb-skip-threshold", float, "EPLB: skip a rebalance that gains less than this (fraction)"),
    ("--eplb-move-threshold", float, "EPLB: keep a layer in place unless moving gains more (fraction)"),
    ("--replica-policy", str, "which replica of an expert a token goes to"),
    ("--expert-timeout", float, "seconds an expert server may take for one layer"),
    ("--page-size", int, "tokens per KV cache page"),
    ("--max-batch-tokens", int, "tokens per forward step"),
    ("--max-running-requests", int, "requests holding KV pages at once"),
    ("--max-queued-requests", int, "requests waiting for admission (beyond: RESOURCE_EXHAUSTED / 429)"),
    ("--max-queued-tokens", int, "prompt tokens of the queued requests"),
    ("--max-context", int, "prompt + generated tokens of one request"),
    ("--default-max-new-tokens", int, "when a request gives none"),
    ("--request-timeout", float, "seconds a request may take (queued + generating)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the demo model)")
    p.add_argument("--demo", action="store_true", help="serve the demo model (written to a cache dir)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: the checkpoint's on a GPU, float32 on the CPU",
    )
    p.add_argument(
        "--num-gpu-experts",
        type=int,
        default=None,
        help="experts < N on the GPU: in the coordinator's process when it runs on one, else on the "
        "GPU server (default: as many as fit in GPU memory / half)",
    )
    p.add_argument(
        "--device", default=None, help="GPU expert server's device: cpu or cuda (default: cuda if available)"
    )
    p.add_argument(
        "--coordinator-device",
        default=None,
        help="device of attention and the KV cache (default: cuda when a GPU is visible, else cpu; "
        "cpu on a GPU machine starts the three-process cluster with a GPU expert server)",
    )
    p.add_argument("--host", default="127.0.0.1", help="coordinator's bind address")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free port)")
    p.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="coordinator's OpenAI-compatible HTTP API and /metrics (default 0: a free port, printed; -1: "
        "off); the expert servers then serve /metrics on free ports too",
    )
    p.add_argument(
        "--transport", default="auto", help="coordinator <-> expert server data path (auto, grpc, shm, ...)"
    )
    p.add_argument("--kv-memory", default=None, help="coordinator KV cache budget, e.g. 512MiB")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of each process (default: a share of this process's cores each, "
        "see expertmesh/cores.py)",
    )
    p.add_argument(
        "--shm-spin-us",
        type=float,
        default=None,
        help="fast paths: poll this long before sleeping, every process (default: "
        f"{cores.default_spin_us():g} here; 0 unless there are more cores than the 3 processes)",
    )
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait until serving")
    p.add_argument(
        "--verbose", action="store_true", help="also echo the children's output (see --log-dir) to stderr"
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="write each child's output to NAME.log here (default: a new directory in the temporary "
        "directory, printed)",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="print one completion of this prompt once serving, then stop everything",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="for --prompt")
    TLSConfig.add_arguments(p, "coordinator")  # passed on to all three processes
    g = p.add_argument_group(
        "coordinator flags passed on when given (defaults: `expertmesh coordinator --help`)"
    )
    g.add_argument(
        "--lora-dir", action="append", default=[], help="root under which adapters may be loaded (repeatable)"
    )
    for flag, typ, text in _COORDINATOR_FLAGS:
        g.add_argument(flag, type=typ, default=None, help=text)
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="recompute shared prompt prefixes (the cache is on by default)",
    )
    x = p.add_argument_group("any other flag of a child: one shell-quoted string each, appended last")
    x.add_argument("--coordinator-args", default="", metavar="ARGS", help='e.g. "--placement p.json"')
    x.add_argument("--gpu-server-args", default="", metavar="ARGS", help='e.g. "--no-cuda-graphs"')
    x.add_argument("--cpu-server-args", default="", metavar="ARGS", help='e.g. "--weight-dtype int8"')


def demo_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "expertmesh" / "demo-model"


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model and not args.demo:
        return Path(args.model)
    from expertmesh.demo import write_demo_model

    # NOTE: copied every time (a few MB) so the cache never serves an older demo model
    return write_demo_model(demo_dir())


def core_plan(args: argparse.Namespace) -> tuple[dict[str, int], float]:
    """torch threads per child and the fast paths' spin budget, from the flags or, by default,
    from the cores this process may use (``expertmesh.cores``)."""
    n = cores.available()
    if args.threads:
        threads = dict.fromkeys(("coordinator", "gpu-server", "cpu-server"), args.threads)
    else:
        on_cuda = args.device.startswith("cuda") if args.device else _nvidia_gpu_visible()
        threads = cores.shares(n, on_cuda)
    spin = cores.default_spin_us(n) if args.shm_spin_us is None else args.shm_spin_us
    return threads, spin


def _nvidia_gpu_visible() -> bool:
    """Whether the GPU server will default to CUDA, without importing torch into this process
    (it would only cost start-up time and memory here): an NVIDIA driver with a GPU, not hidden
    by ``CUDA_VISIBLE_DEVICES``. Only the thread shares depend on it."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def child_env() -> dict[str, str]:
    """The children's environment: this one's plus the cluster token they share (kept if the
    operator set one; else 32 random bytes, new for each ``up``)."""
    token = os.environ.get(auth.CLUSTER_TOKEN_ENV) or secrets.token_urlsafe(32)
    return dict(os.environ, **{auth.CLUSTER_TOKEN_ENV: token})


def tls_flags(tls: TLSConfig) -> tuple[list[str], list[str]]:
    """(The expert servers' TLS flags, the coordinator's). Paths are made absolute;
    the children get them as flags, so that a flag given to ``up`` wins over their environment
    exactly as it would for ``up`` itself."""
    if not tls.server_enabled:
        return [], []
    server = []
    for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)):
        server += [flag, str(Path(path).resolve())] if path else []
    coord = [*server, *(["--tls-server-name", tls.server_name] if tls.server_name else [])]
    return server, coord


def client_tls(tls: TLSConfig) -> TLSConfig | None:
    """This process as a client of its coordinator: trusts ``--tls-ca`` (no client certificate:
    the coordinator's public port never asks for one)."""
    return TLSConfig(ca=tls.ca, server_name=tls.server_name) if tls.server_enabled else None


def plan(args: argparse.Namespace, model: Path) -> Topology:
    """The topology for ``args`` (GPU memory asked only when a GPU coordinator is possible)."""
    on_gpu = (args.coordinator_device or "cuda").startswith("cuda")
    visible = (on_gpu or args.coordinator_device is None) and _nvidia_gpu_visible()
    return topology.from_args(args, model, topology.gpu_free_bytes() if visible else None)


def build_hybrid(args: argparse.Namespace, model: Path, topo: Topology) -> tuple[list[Child], list[str]]:
    """The children of a GPU coordinator: (the CPU expert server, if any; the coordinator's command
    without its expert-server flags)."""
    cli = [sys.executable, "-m", "expertmesh.cli"]
    _, spin = core_plan(args)
    threads = topology.hybrid_threads(args.threads or cores.available(), topo.cpu_server)
    if args.threads:
        threads = dict.fromkeys(threads, args.threads)
    server_tls, coord_tls = tls_flags(TLSConfig.from_args(args))
    servers = []
    if topo.cpu_server:
        cpu_cmd = [*cli, "cpu-server", "--model", str(model), "--dtype", topo.dtype, "--port", "0"]
        cpu_cmd += ["--shm-spin-us", f"{spin:g}", "--threads", str(threads["cpu-server"]), *server_tls]
        cpu_cmd += ["--metrics-port", "0"] if args.http_port >= 0 else []
        servers.append(Child("cpu-server", cpu_cmd, args.verbose))
    coord_cmd = [
        *cli, "coordinator", "--model", str(model), "--dtype", topo.dtype,
        "--host", args.host, "--port", str(args.port), "--device", topo.coordinator_device,
        "--transport", args.transport, "--threads", str(threads["coordinator"]), "--shm-spin-us", f"{spin:g}",
    ]  # fmt: skip
    if topo.cpu_server:
        coord_cmd += ["--num-gpu-experts", str(topo.num_local)]
    if args.kv_memory:
        coord_cmd += ["--kv-memory", args.kv_memory]
    if args.http_port >= 0:
        coord_cmd += ["--http-port", str(args.http_port)]
    return servers, [*coord_cmd, *coord_tls]


def build_children(args: argparse.Namespace, model: Path, num_experts: int) -> tuple[Child, Child, list[str]]:
    cli = [sys.executable, "-m", "expertmesh.cli"]
    threads, spin = core_plan(args)
    server_tls, coord_tls = tls_flags(TLSConfig.from_args(args))
    dtype = args.dtype or "float32"
    common = ["--model", str(model), "--dtype", dtype, "--port", "0", "--shm-spin-us", f"{spin:g}"]
    common += server_tls
    if args.http_port >= 0:  # with the coordinator's HTTP on, the servers' metrics too (free ports)
        common += ["--metrics-port", "0"]
    gpu_cmd = [*cli, "gpu-server", *common, "--threads", str(threads["gpu-server"])]
    gpu_cmd += ["--device", args.device] if args.device else []
    cpu_cmd = [*cli, "cpu-server", *common, "--threads", str(threads["cpu-server"])]
    n = num_experts // 2 if args.num_gpu_experts is None else args.num_gpu_experts
    coord_tail = [
        "--host", args.host, "--port", str(args.port), "--device", args.coordinator_device or "cpu",
        "--num-gpu-experts", str(n), "--transport", args.transport,
        "--threads", str(threads["coordinator"]), "--shm-spin-us", f"{spin:g}",
    ]  # fmt: skip
    if args.kv_memory:
        coord_tail += ["--kv-memory", args.kv_memory]
    if args.http_port >= 0:
        coord_tail += ["--http-port", str(args.http_port)]
    coord_cmd = [*cli, "coordinator", "--model", str(model), "--dtype", dtype, *coord_tail, *coord_tls]
    return Child("gpu-server", gpu_cmd, args.verbose), Child("cpu-server", cpu_cmd, args.verbose), coord_cmd


def coordinator_flags(args: argparse.Namespace) -> list[str]:
    """The coordinator flags given to ``up`` (``_COORDINATOR_FLAGS``, ``--lora-dir`` made absolute)."""
    out = []
    for d in args.lora_dir:
        out += ["--lora-dir", str(Path(d).resolve())]
    for flag, _, _ in _COORDINATOR_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if getattr(args, "no_prefix_cache", False):
        out.append("--no-prefix-cache")
    return out


def _log_file(args: argparse.Namespace, name: str) -> Path | None:
    return Path(args.log_dir) / f"{name}.log" if getattr(args, "log_dir", None) else None


class Stopped(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    try:
        model = resolve_model(args)
        topo = plan(args, model)
        tls = TLSConfig.from_args(args)  # a missing file or a lone --tls-cert fails here
        if (tls.ca or tls.server_name) and not tls.server_enabled:
            raise ValueError(
                "--tls-ca/--tls-server-name need --tls-cert and --tls-key here: "
                "one certificate serves all three processes of `expertmesh up`"
            )
        for flag in ("coordinator", "gpu_server", "cpu_server"):
            shlex.split(getattr(args, f"{flag}_args"))  # unbalanced quotes fail here, not in a child
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        else:
            args.log_dir = tempfile.mkdtemp(prefix="expertmesh-up-")
    except (ValueError, OSError) as e:  # ConfigError, DemoModelMissing, TLSError, unreadable directory
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"expertmesh up: {topo.describe()}", file=sys.stderr, flush=True)
    if topo.gpu_server:
        args = argparse.Namespace(**{**vars(args), "dtype": topo.dtype})
        from expertmesh.config import ModelConfig

        gpu, cpu, coord_cmd = build_children(args, model, ModelConfig.from_dir(model).num_experts)
        servers = [("--gpu-server", gpu), ("--cpu-server", cpu)]
    else:
        hybrid, coord_cmd = build_hybrid(args, model, topo)
        servers = [("--cpu-server", c) for c in hybrid]
    coord_cmd += [*coordinator_flags(args), *shlex.split(args.coordinator_args)]
    env = child_env()  # NOTE: the same token for the servers and the coordinator
    for _, c in servers:
        c.env = env
        c.cmd += shlex.split(args.gpu_server_args if c.name == "gpu-server" else args.cpu_server_args)
        c.log = _log_file(args, c.name)
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return _run(servers, coord_cmd, env, args, children, stop)
    except Stopped:
        return 0
    finally:
        for c in reversed(children):  # coordinator first, then the expert servers
            c.stop(timeout=15)


def _wait(children: list[Child], stop: threading.Event, until, timeout: float, what: str) -> None:
    """Polls ``until()``; fails when a child exits, the timeout passes or a signal arrives."""
    deadline = time.monotonic() + timeout
    while not until():
        if stop.is_set():
            raise Stopped
        dead = [c for c in children if not c.alive()]
        if dead:
            raise RuntimeError(dead[0].report())
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        stop.wait(0.1)


def _run(
    servers: list[tuple[str, Child]],
    coord_cmd: list[str],
    env: dict[str, str],
    args,
    children: list[Child],
    stop,
) -> int:
    """``servers``: (the coordinator's flag naming it, the expert server) for each expert server."""
    from expertmesh.health import check

    tls = client_tls(TLSConfig.from_args(args))
    try:
        for _, c in servers:
            c.start()
            children.append(c)
        _wait(
            children,
            stop,
            lambda: all(c.port for _, c in servers),
            args.startup_timeout,
            "the expert servers",
        )
        flags = [a for flag, c in servers for a in (flag, f"127.0.0.1:{c.port}")]
        coord = Child(
            "coordinator", [*coord_cmd, *flags], args.verbose, env=env, log=_log_file(args, "coordinator")
        )
        coord.start()
        children.append(coord)
        _wait(children, stop, lambda: coord.port, args.startup_timeout, "the coordinator")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        addr = f"{host}:{coord.port}"
        _wait(
            children,
            stop,
            lambda: check(addr, 1.0, tls=tls) == "SERVING",
            args.startup_timeout,
            "health SERVING",
        )
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"expertmesh is serving on {addr}", flush=True)
    # NOTE: one-shot (--prompt) stops by itself: no Ctrl-C hint then
    hint = "" if args.prompt is not None else "; Ctrl-C stops all"
    where = ", ".join(f"{c.name.replace('-', ' expert ')} 127.0.0.1:{c.port}" for _, c in servers)
    print(f"  {where or 'every expert in the coordinator'}{hint}", file=sys.stderr, flush=True)
    if coord.http_port is not None and args.prompt is None:
        web = "https" if tls is not None else "http"  # the coordinator's HTTP uses its certificate
        print(
            f"  OpenAI-compatible API {web}://{host}:{coord.http_port}/v1, Prometheus {web}://{host}:{coord.http_port}/metrics",
            file=sys.stderr,
            flush=True,
        )
        metrics = ", ".join(f"http://127.0.0.1:{c.http_port}/metrics" for _, c in servers if c.http_port)
        if metrics:
            print(f"  expert servers' Prometheus metrics {metrics}", file=sys.stderr, flush=True)
    _, spin = core_plan(args)
    threads = ", ".join(f"{c.name} {_flag(c.cmd, '--threads')}" for c in children)
    print(
        f"  torch threads: {threads} ({cores.available()} cores); fast-path spin {spin:g} us",
        file=sys.stderr,
        flush=True,
    )
    echo = "; --verbose echoes them here too" if not args.verbose else ""
    logs = ", ".join(f"{c.name}.log" for c in children)
    print(f"  logs in {args.log_dir}: {logs}{echo}", file=sys.stderr, flush=True)
    if args.prompt is not None:
        return _complete(addr, args.prompt, args.max_new_tokens, tls)
    while not stop.wait(0.5):
        dead = [c for c in children if not c.alive()]
        if dead:
            print(f"error: {dead[0].report()}", file=sys.stderr)
            return 1
    print("stopping", file=sys.stderr, flush=True)
    return 0


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else "?"


def _complete(addr: str, prompt: str, max_new_tokens: int, tls: TLSConfig | None = None) -> int:
    """Streams one completion of ``prompt`` to stdout (the ``make demo`` path)."""
    import grpc

    from expertmesh.client import Client

    try:
        with Client(addr, tls=tls) as client:
            sys.stdout.write(prompt)
            for chunk in client.stream(prompt, max_new_tokens=max_new_tokens):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0
