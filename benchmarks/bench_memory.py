"""Expert server memory through load, placement pushes and a rebalance, and load speed.

Writes (or takes, ``--model``) a random checkpoint of routed experts at Qwen3-30B-A3B's widths
(48 layers x 128 experts of 2048 x 768: 58 GB in bf16), warms the page cache with it, then for
each server kind asked (``--servers gpu,cpu``) starts one expert server holding every expert
and reports:

- load: seconds from the process start to SERVING and the GB/s that makes (expert bytes in the
  checkpoint / seconds), and the loader's own line (the progress output's closing line);
- memory after the first placement push (equal to the preloaded one), after a rebalance that
  changes ``--move-frac`` of every layer's slots (half rotated among themselves, half turned
  into replicas of other experts), after a second rebalance back (the dropped experts read
  again), and after a prepared-then-aborted change: ``nvidia-smi``'s memory of the server
  process (GPU), its RSS and peak RSS (/proc), and the server's own Describe figures
  (expert bytes, their peak, torch's CUDA bytes and peak).

Runs anywhere with ``--layers N`` small (``--servers cpu`` without a GPU); the device command
is in benchmarks/RESULTS.md. Shapes: E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from expertmesh import wire  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from expertmesh.v1 import expert_worker_pb2 as pb  # noqa: E402
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc  # noqa: E402
from expertmesh.worker_api import ExpertRequest, WorkerInfo  # noqa: E402

QWEN3_30B = dict(hidden=2048, inter=768, experts=128, layers=48, top_k=8)
_LISTEN = re.compile(r"listening on (\S+):(\d+)")
_DONE = re.compile(r"experts: .*\(done in [0-9.]+s\)")
GB = 1e9


# ---------------------------------------------------------------------- checkpoint


def write_checkpoint(
    out: Path,
    hidden: int,
    inter: int,
    experts: int,
    layers: int,
    dtype: torch.dtype = torch.bfloat16,
    fused: bool = False,
    seed: int = 0,
) -> Path:
    """A qwen3_moe checkpoint of routed experts only (what an expert server reads), one shard
    per layer, per-expert tensors as HF stores Qwen3-30B-A3B (``fused``: the stacked
    ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` layout). Kept when ``out`` already
    holds one of this shape."""
    cfg = dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 512), head_dim=128, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=min(8, experts), norm_topk_prob=True, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    stamp = dict(cfg, bench_dtype=str(dtype), bench_fused=fused, bench_seed=seed)
    if (out / "bench.json").exists() and json.loads((out / "bench.json").read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    # NOTE: slices of one pool of normal samples at random offsets: drawing tens of GB of fresh
    # samples would take longer than everything measured
    pool = torch.randn(1 << 22, generator=g)
    pools: dict[int, torch.Tensor] = {}  # fan_in -> the pool scaled, in dtype

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        p = pools.setdefault(fan_in, (pool * fan_in**-0.5).to(dtype))
        n = torch.Size(shape).numel()
        if n > p.numel():
            p = p.repeat(-(-n // p.numel()) + 1)
        start = int(torch.randint(0, p.numel() - n + 1, (1,), generator=g))
        return p[start : start + n].clone().view(shape)

    weight_map = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        if fused:
            shard = {
                f"{p}.gate_up_proj": rnd(experts, 2 * inter, hidden, fan_in=hidden),
                f"{p}.down_proj": rnd(experts, hidden, inter, fan_in=inter),
            }
        else:
            shard = {}
            for e in range(experts):
                shard[f"{p}.{e}.gate_proj.weight"] = rnd(inter, hidden, fan_in=hidden)
                shard[f"{p}.{e}.up_proj.weight"] = rnd(inter, hidden, fan_in=hidden)
                shard[f"{p}.{e}.down_proj.weight"] = rnd(hidden, inter, fan_in=inter)
        name = f"experts-{layer:03d}.safetensors"
        save_file(shard, str(out / name))
        weight_map.update(dict.fromkeys(shard, name))
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "bench.json").write_text(json.dumps(stamp))
    return out


def warm_page_cache(model: Path) -> float:
    """Reads every shard once (the loads below then come from the page cache); returns GB read."""
    n = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / GB


# ---------------------------------------------------------------------- the server


class Server:
    """One expert server process and a gRPC stub to it."""

    def __init__(self, kind: str, model: Path, *extra: str, timeout: float = 3600.0) -> None:
        cmd = [sys.executable, "-m", "expertmesh.cli", f"{kind}-server", "--model", str(model), "--port", "0"]
        cmd += ["--no-shm", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.t0 = time.monotonic()
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env
        )
        self.lines: list[str] = []
        self.port = 0
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = _LISTEN.search(line)
            if m:
                self.port = int(m.group(2))
                break
        if not self.port:
            self.stop()
            raise RuntimeError(f"{kind}-server did not start:\n" + "".join(self.lines))
        threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
        ).start()  # type: ignore[union-attr]
        opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=opts)
        self.stub = pb_grpc.ExpertWorkerStub(self.channel)

    def wait_serving(self, timeout: float = 3600.0) -> float:
        """Seconds from the process start until health says SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.lines))
            st = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            if st == health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic() - self.t0
            time.sleep(0.02)
        raise TimeoutError("server never reached SERVING")

    def describe(self) -> WorkerInfo:
        return wire.decode_info(self.stub.Describe(pb.DescribeRequest(), timeout=60))

    def apply(self, phase: int, generation: int, table: dict[int, list[int]] | None = None) -> None:
        layers = [pb.LayerSlots(layer=k, experts=v) for k, v in sorted((table or {}).items())]
        self.stub.ApplyPlacement(
            pb.ApplyPlacementRequest(phase=phase, generation=generation, layers=layers), timeout=3600
        )

    def push(self, generation: int, table: dict[int, list[int]]) -> None:
        self.apply(pb.ApplyPlacementRequest.PREPARE, generation, table)
        self.apply(pb.ApplyPlacementRequest.COMMIT, generation)

    def forward(self, req: ExpertRequest, dtype: torch.dtype) -> torch.Tensor:
        msg = wire.encode_request(req, dtype)
        (resp,) = list(self.stub.Forward(iter([msg]), timeout=120))
        return wire.decode(resp.output)

    def loader_line(self) -> str:
        return next((ln.strip() for ln in self.lines if _DONE.search(ln)), "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> None:
    """VmHWM back to the current RSS (Linux clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _smi(*query: str) -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_used_mib(pid: int, device: str) -> int | None:
    """nvidia-smi's memory of process ``pid``; where it does not list the process (a container's
    own pid namespace), the memory in use on the server's GPU; None without nvidia-smi."""
    out = _smi("--query-compute-apps=pid,used_memory")
    for line in (out or "").splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid):
            return int(mib)
    index = device.partition(":")[2] or "0"
    total = _smi("--query-gpu=memory.used", "-i", index)
    return int(total.split()[0]) if total else None


# ---------------------------------------------------------------------- placements


def rebalanced(layer_experts: list[int], frac: float, shift: int) -> list[int]:
    """``frac`` of the slots change: the first half of them rotate among themselves, the
    second half become replicas of the experts in the first slots (their own experts dropped).
    ``shift`` picks which slots (a layer-dependent offset spreads them)."""
    s = len(layer_experts)
    n = max(2, int(round(s * frac)))
    idx = [(shift + k * max(1, s // n)) % s for k in range(n)]
    out = list(layer_experts)
    rot, rep = idx[: n // 2], idx[n // 2 :]
    for a, b in zip(rot, rot[1:] + rot[:1]):
        out[a] = layer_experts[b]
    for k, slot in enumerate(rep):
        out[slot] = layer_experts[k % s]
    return out


def snapshot(srv: Server, label: str, device: str = "") -> dict:
    info = srv.describe()
    pid = srv.proc.pid
    row = dict(
        step=label,
        generation=info.generation,
        expert_gb=info.weight_bytes / GB,
        # NOTE: getattr: a server from before these fields (a before/after run) reports 0
        expert_peak_gb=getattr(info, "peak_weight_bytes", 0) / GB,
        rss_gb=proc_kib(pid, "VmRSS") * 1024 / GB,
        peak_rss_gb=proc_kib(pid, "VmHWM") * 1024 / GB,
        cuda_alloc_gb=getattr(info, "device_allocated_bytes", 0) / GB,
        cuda_peak_gb=getattr(info, "device_peak_allocated_bytes", 0) / GB,
        nvidia_smi_gb=None if not device or (m := gpu_used_mib(pid, device)) is None else m * (1 << 20) / GB,
    )
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def run_server(kind: str, model: Path, args: argparse.Namespace, expert_gb: float) -> list[dict]:
    extra = ["--dtype", args.dtype, "--experts", "all"]
    if kind == "gpu":
        extra += ["--device", args.device]
    else:
        extra += ["--weight-dtype", args.weight_dtype]
    srv = Server(kind, model, *extra)
    rows = []
    gpu = args.device if kind == "gpu" and args.device.startswith("cuda") else ""
    try:
        secs = srv.wait_serving()
        what = f"{kind}-server" + (f" ({args.weight_dtype})" if kind == "cpu" else "")
        print(
            f"{what}: SERVING after {secs:.1f}s: {expert_gb / secs:.2f} GB/s of experts from the page cache",
            flush=True,
        )
        print(f"  loader: {srv.loader_line()}", flush=True)
        rows.append(dict(step="load", kind=kind, seconds=secs, gb_per_s=expert_gb / secs))
        info = srv.describe()
        layers = list(info.moe_layers)
        live = {layer: list(range(info.num_experts)) for layer in layers}
        srv.push(1, live)
        rows.append(snapshot(srv, "first push (equal to the preloaded placement)", gpu))
        moved = {layer: rebalanced(live[layer], args.move_frac, i) for i, layer in enumerate(layers)}
        t0 = time.perf_counter()
        srv.push(2, moved)
        print(
            f"  rebalance {args.move_frac:.0%} of slots (moves within layers): {time.perf_counter() - t0:.2f}s",
            flush=True,
        )
        rows.append(snapshot(srv, f"rebalance {args.move_frac:.0%}", gpu))
        t0 = time.perf_counter()
        srv.push(3, live)
        print(f"  rebalance back (dropped experts read again): {time.perf_counter() - t0:.2f}s", flush=True)
        rows.append(snapshot(srv, "rebalance back", gpu))
        srv.apply(pb.ApplyPlacementRequest.PREPARE, 4, moved)
        srv.apply(pb.ApplyPlacementRequest.ABORT, 4)
        rows.append(snapshot(srv, "prepare + abort", gpu))
    finally:
        srv.stop()
        if args.log:
            # the server's own timestamps say where its start went before the loader
            args.log.mkdir(parents=True, exist_ok=True)
            name = f"{kind}-server" + (f"-{args.weight_dtype}" if kind == "cpu" else "") + ".log"
            (args.log / name).write_text("".join(srv.lines))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, default=None, help="use this checkpoint (default: write one to --dir)"
    )
    p.add_argument("--dir", type=Path, default=Path("/tmp/expertmesh-bench-memory"))
    p.add_argument("--layers", type=int, default=QWEN3_30B["layers"])
    p.add_argument("--experts", type=int, default=QWEN3_30B["experts"])
    p.add_argument("--hidden", type=int, default=QWEN3_30B["hidden"])
    p.add_argument("--inter", type=int, default=QWEN3_30B["inter"])
    p.add_argument("--fused", action="store_true", help="stacked gate_up_proj/down_proj tensors")
    p.add_argument("--servers", default="gpu,cpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-dtype", default="bfloat16", help="the CPU server's --weight-dtype")
    p.add_argument("--move-frac", type=float, default=0.25)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--log", type=Path, default=None, help="keep each server's log in this directory")
    args = p.parse_args()
    model = args.model or write_checkpoint(
        args.dir, args.hidden, args.inter, args.experts, args.layers, fused=args.fused
    )
    t0 = time.perf_counter()
    gb = warm_page_cache(model)
    print(
        f"checkpoint {model}: {gb:.2f} GB, read once in {time.perf_counter() - t0:.1f}s (page cache warm)",
        flush=True,
    )
    # NOTE: the experts' bytes, not the files': a --model with the rest of the model too
    reader = CheckpointReader(model)
    cfg = reader.config
    expert_gb = reader.expert_nbytes() * cfg.num_experts * len(cfg.moe_layer_ids) / GB
    rows = []
    for kind in args.servers.split(","):
        rows += run_server(kind.strip(), model, args, expert_gb)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
