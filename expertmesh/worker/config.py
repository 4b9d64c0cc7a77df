"""``WorkerConfig``: one expert server's settings, frozen and validated (errors, not asserts),
built once from the command line by :meth:`WorkerConfig.from_args` (the GPU and CPU servers'
entry points only add their own flags and defaults)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch

from expertmesh import auth, cores, wire
from expertmesh.tls import TLSConfig
from expertmesh.transport import segment

KINDS = ("gpu", "cpu")
LINK_ENV = "EXPERTMESH_LINK"  # the device link: unset/1 auto, 0 off, force (one GPU too)
LINK_MODES = {"": "auto", "1": "auto", "auto": "auto", "0": "off", "off": "off", "force": "force"}
DTYPES = ("float32", "bfloat16", "float16")
# --combine-wait-us default: no holds. Measured (benchmarks/RESULTS.md, bench_two_coordinators),
# a 1000 us hold doubled the rows per layer call but cut tokens/s: 608 -> 528 on the 2-core VM,
# 126 -> 78 at full size on an H200 (a hold is paid 48 times a token, a merged call saves less)
COMBINE_WAIT_US = 0.0


@dataclass(frozen=True)
class WorkerConfig:
    kind: str  # "gpu" | "cpu"
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    experts: str = "all"  # preloaded before any placement arrives: all | none | 0-15,32
    capacity: int | None = None  # local slots per layer; default: the model's expert count
    max_message_mb: int = 256
    shm: bool = True  # offer the shared-memory (and, on CUDA, CUDA IPC) fast paths
    tcp: bool = True  # offer the TCP data path (expertmesh/transport/tcp.py)
    data_port: int = 0  # its listening port on ``host`` (0 = a free one, printed)
    # fast paths: poll this long for the next request before sleeping (0 where cores are scarce)
    shm_spin_us: float = field(default_factory=cores.default_spin_us)
    metrics_port: int | None = None  # Prometheus /metrics here (0 = a free one); None = off

    max_loras: int = 4  # MoE LoRA adapters resident in device buffers (LRU beyond)
    # control RPCs (ApplyPlacement, LoadAdapter, UnloadAdapter) need it when set (expertmesh/auth.py)
    cluster_token: str | None = field(default=None, repr=False)
    # TLS only with a certificate; with a CA too, client certificates are required
    tls: TLSConfig | None = None
    # SIGTERM: refuse new work, wait this long for coordinators to move off, then exit
    drain_timeout_s: float = 30.0
    link: str = "auto"  # the device link: auto | force | off (expertmesh/transport/server.py)
    # bytes a placement prepare may read ahead beside the live experts (None: one layer of slots)
    staging_mb: int | None = None
    spare_mb: int | None = None
    # fast-path requests of several coordinators for one layer computed together (combine.py)
    combine_streams: bool = False
    # with it: the longest a request is held for other coordinators' request of its layer
    combine_wait_us: float = COMBINE_WAIT_US

    def __post_init__(self) -> None:
        if self.link not in ("auto", "force", "off"):
            raise ValueError(f"device link mode {self.link!r}: expected auto, force or off")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if self.kind not in KINDS:
            raise ValueError(f"expert server kind {self.kind!r}: expected one of {KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {DTYPES}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} outside 0..65535")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port {self.data_port} outside 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port} outside 0..65535")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"--capacity must be positive, got {self.capacity}")
        if self.staging_mb is not None and self.staging_mb < 0:
            raise ValueError(f"--placement-staging-mb must be >= 0, got {self.staging_mb}")
        if self.spare_mb is not None and self.spare_mb < 0:
            raise ValueError(f"--placement-spare-mb must be >= 0, got {self.spare_mb}")
        if not 0 <= self.combine_wait_us <= 1e6:
            raise ValueError(f"--combine-wait-us must be in [0, 1000000], got {self.combine_wait_us}")
        if self.max_loras <= 0:
            raise ValueError(f"--max-loras must be positive, got {self.max_loras}")
        if self.max_message_mb <= 0:
            raise ValueError(f"--max-message-mb must be positive, got {self.max_message_mb}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"--device {self.device}: CUDA is not available on this machine (use --device cpu)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return wire.parse_dtype(self.dtype)

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb << 20

    @property
    def staging_bytes(self) -> int | None:
        return None if self.staging_mb is None else self.staging_mb << 20

    @property
    def spare_bytes(self) -> int | None:
        return None if self.spare_mb is None else self.spare_mb << 20

    @property
    def fast_paths(self) -> tuple[str, ...]:
        tcp = ("tcp",) if self.tcp else ()
        if not self.shm or not segment.available():
            return tcp
        return (*tcp, "shm", "cuda_ipc") if self.device.startswith("cuda") else (*tcp, "shm")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
        """The flags of this config (called by the expert servers' entry points only)."""
        p.add_argument("--model", required=True, help="HF checkpoint directory (shared with the coordinator)")
        p.add_argument("--host", default=WorkerConfig.host)
        p.add_argument("--port", type=int, default=default_port, help="0 = a free port (printed)")
        p.add_argument(
            "--dtype", default=WorkerConfig.dtype, choices=list(DTYPES), help="the experts' compute dtype"
        )
        p.add_argument(
            "--experts",
            default=WorkerConfig.experts,
            help="experts to preload per layer: all | none | 0-15,32",
        )
        p.add_argument(
            "--capacity", type=int, default=None, help="local slots per layer (default: expert count)"
        )
        p.add_argument("--max-message-mb", type=int, default=WorkerConfig.max_message_mb)
        p.add_argument(
            "--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0 = a free port)"
        )
        p.add_argument(
            "--no-shm",
            action="store_true",
            help="offer no shared-memory or CUDA IPC fast path: coordinators on this host use gRPC",
        )
        p.add_argument(
            "--no-tcp",
            action="store_true",
            help="offer no TCP data path (coordinators on other hosts then use gRPC)",
        )
        p.add_argument(
            "--data-port",
            type=int,
            default=WorkerConfig.data_port,
            help="the TCP data path's port on --host (0 = a free one, printed)",
        )
        p.add_argument(
            "--shm-spin-us",
            type=float,
            default=cores.default_spin_us(),
            help="fast paths: poll this long for the next request before sleeping (0 = always sleep; "
            "default: %(default)g here, 0 unless there are more cores than the 3 processes of a cluster)",
        )
        p.add_argument(
            "--combine-streams",
            action="store_true",
            help="several coordinators share this server: compute their fast-path requests for the same "
            "layer that wait together as one batch (off: one after the other)",
        )
        p.add_argument(
            "--combine-wait-us",
            type=float,
            default=COMBINE_WAIT_US,
            help="with --combine-streams: hold a request up to this long for the other coordinators' "
            "request of the same layer, only while several coordinators stream (0 = never hold; default %(default)g)",
        )
        p.add_argument(
            "--max-loras",
            type=int,
            default=4,
            help="MoE LoRA adapters resident at once (least recently used evicted, reloaded on demand)",
        )
        p.add_argument(
            "--cluster-token",
            default=None,
            help=f"secret the coordinator must send with placement/adapter pushes (or env {auth.CLUSTER_TOKEN_ENV})",
        )
        TLSConfig.add_arguments(p, "expert-server")
        p.add_argument(
            "--placement-staging-mb",
            type=int,
            default=None,
            help="memory a placement change may use beside the resident experts to read new ones "
            "ahead of its commit (default: one layer of slots; 0: every new expert is read during "
            "the commit, which then takes longer)",
        )
        p.add_argument(
            "--placement-spare-mb",
            type=int,
            default=None,
            help="spare expert slots kept in the layers' allocations between placement changes, so "
            "a layer that grows or shrinks rewrites only its changed slots (default: half the "
            "staging budget; it counts against that budget; 0: every resize is a new allocation)",
        )

        p.add_argument(
            "--drain-timeout",
            type=float,
            default=WorkerConfig.drain_timeout_s,
            help="on SIGTERM: health NOT_SERVING, new streams/layers refused (UNAVAILABLE), in-flight "
            "layers finished; exit once coordinators closed their streams or after this many seconds",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, kind: str, device: str) -> WorkerConfig:
        """The one place the command line becomes a WorkerConfig (GPU and CPU servers alike)."""
        return cls(
            kind=kind,
            model_dir=args.model,
            host=args.host,
            port=args.port,
            dtype=args.dtype,
            device=device,
            experts=args.experts,
            capacity=args.capacity,
            max_message_mb=args.max_message_mb,
            shm=not args.no_shm,
            tcp=not args.no_tcp,
            data_port=args.data_port,
            shm_spin_us=args.shm_spin_us,
            metrics_port=args.metrics_port,
            max_loras=args.max_loras,
            cluster_token=args.cluster_token or auth.token_from_env(auth.CLUSTER_TOKEN_ENV),
            tls=TLSConfig.from_args(args),
            drain_timeout_s=args.drain_timeout,
            link=link_mode(os.environ.get(LINK_ENV, "")),
            staging_mb=args.placement_staging_mb,
            spare_mb=args.placement_spare_mb,
            combine_streams=args.combine_streams,
            combine_wait_us=args.combine_wait_us,
        )


def link_mode(value: str) -> str:
    """``EXPERTMESH_LINK`` -> a WorkerConfig.link mode (ValueError names the accepted values)."""
    mode = LINK_MODES.get(value.strip().lower())
    if mode is None:
        raise ValueError(f"{LINK_ENV}={value!r}: expected 0, 1 or force")
    return mode
