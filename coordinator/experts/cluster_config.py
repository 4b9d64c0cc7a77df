"""Where the expert servers are and how the coordinator uses them: ``ServerSpec`` and the
frozen ``ClusterConfig`` (and its command-line flags)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace

from coordinator.experts import dns
from expertmesh import auth, cores
from expertmesh import placement as pl
from expertmesh.tls import TLSConfig
from expertmesh.transport import negotiate
from expertmesh.transport.tcp import split_address

REPLICA_POLICIES = ("static", "round_robin", "load_aware")
# --- the device link (expertmesh/transport/link.py): EXPERTMESH_LINK ---
LINK_MODES = ("auto", "off", "force")  # auto: two GPUs with peer access only; force: one GPU too
LINK_ENV = "EXPERTMESH_LINK"


def link_mode_from_env() -> str:
    """``EXPERTMESH_LINK``: unset/1/auto -> auto, 0/off -> off, force -> force."""
    v = os.environ.get(LINK_ENV, "").strip().lower()
    return {"": "auto", "1": "auto", "0": "off"}.get(v, v)


LOCAL = "local"  # the in-process member's name, in placement files and status
LOCAL_ADDRESS = "in-process"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    address: str  # HOST:PORT, or dns:///NAME:PORT until ClusterConfig.resolved
    kind: str  # "gpu" | "cpu"
    dns: str = ""  # the dns:///NAME:PORT this server was found by ("" = listed)
    # the coordinator's own experts (coordinator/experts/local.py): no process, no gRPC. Its kind
    # is "gpu" (the fast share of a hybrid split: sent last, awaited first, never deferred, the
    # prefill threshold's full server) even when a CPU coordinator computes it with torch
    in_process: bool = False
    # HOST:PORT where the coordinator reaches the server's TCP data path ("" = the gRPC
    # address's host and the port the server advertises): something in between (a NAT, the
    # loopback latency proxy of expertmesh/transport/delay_proxy.py)
    data_address: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"expert server {self.name}: kind {self.kind!r}, expected gpu or cpu")
        if self.in_process != (self.name == LOCAL):
            raise ValueError(f"the name {LOCAL!r} is the in-process member's and only its (got {self})")
        dns.parse(self.address)  # a malformed dns: address fails here, at the command line
        if self.data_address:
            split_address(self.data_address)

    @classmethod
    def local(cls) -> ServerSpec:
        return cls(LOCAL, LOCAL_ADDRESS, "gpu", in_process=True)


@dataclass(frozen=True)
class ClusterConfig:
    servers: tuple[ServerSpec, ...]
    num_gpu_experts: int | None = None  # None: all on GPU servers if no CPU server, etc., else half
    placement_file: str | None = None
    replica_policy: str = "static"
    gpu_prefill_token_threshold: int = 0  # 0 = off
    timeout_s: float = 30.0
    transport: str = "auto"  # auto | grpc | tcp | shm | cuda_ipc (expertmesh/transport/negotiate.py)
    max_message_mb: int = 256
    shm_ring_mb: float = 64  # per server stream; a payload that does not fit goes over gRPC
    # poll for a fast-path answer this long before sleeping (0 where cores are scarce)
    shm_spin_us: float = field(default_factory=cores.default_spin_us)
    cluster_token: str | None = field(default=None, repr=False)  # sent with placement pushes
    tls: TLSConfig | None = None  # TLS to the expert servers (the coordinator's --tls-*)
    # each token's N lowest-weight CPU-server experts are merged one layer later
    # (coordinator/model/deferral.py); 0 = off. CHANGES RESULTS (an approximation, opt-in).
    cpu_defer_experts: int = 0
    # the device link to a GPU expert server (coordinator/model/remote_graphs.py); read from
    # EXPERTMESH_LINK where the config is made (LINK_MODES)
    device_link: str = field(default_factory=link_mode_from_env)
    # seconds between two resolutions of the dns:/// servers' names
    dns_refresh_s: float = 10.0
    dns_hosts_file: str | None = None  # looked up before the system resolver (dns.resolver_for)
    # several coordinators share these servers: the placement role is a lease of this many seconds
    # on them (coordinator/experts/pool.py); 0 = this coordinator alone places experts on them
    placement_lease_s: float = 0.0

    def __post_init__(self) -> None:
        if self.device_link not in LINK_MODES:
            raise ValueError(f"{LINK_ENV}={self.device_link!r}: expected 0, 1, auto, off or force")
        if self.replica_policy not in REPLICA_POLICIES:
            raise ValueError(f"--replica-policy {self.replica_policy!r}: expected one of {REPLICA_POLICIES}")
        if self.transport not in negotiate.CHOICES:
            raise ValueError(f"--transport {self.transport!r}: expected one of {negotiate.CHOICES}")
        if self.shm_ring_bytes < 4096:
            raise ValueError(f"--shm-ring-mb {self.shm_ring_mb}: the ring needs at least 4 KiB")
        if self.timeout_s <= 0:
            raise ValueError(f"--expert-timeout must be positive, got {self.timeout_s}")
        if self.dns_refresh_s <= 0:
            raise ValueError(f"--dns-refresh-s must be positive, got {self.dns_refresh_s}")
        if self.max_message_mb <= 0:
            raise ValueError(f"max_message_mb must be positive, got {self.max_message_mb}")
        if self.gpu_prefill_token_threshold < 0:
            raise ValueError(
                f"--gpu-prefill-token-threshold must be >= 0, got {self.gpu_prefill_token_threshold}"
            )
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate expert server names {names}")
        if self.cpu_defer_experts < 0:
            raise ValueError(f"--cpu-defer-experts must be >= 0, got {self.cpu_defer_experts}")
        if self.cpu_defer_experts and not self.cpu:
            raise ValueError(
                "--cpu-defer-experts needs a CPU expert server (only CPU-server experts are deferred)"
            )
        if not 0 <= self.placement_lease_s <= 300:
            raise ValueError(f"--placement-lease {self.placement_lease_s:g}: expected 0 (off) or up to 300 s")
        if self.placement_lease_s and any(s.in_process for s in self.servers):
            # NOTE: the pool's one placement covers the servers every coordinator shares; a
            # coordinator's own experts are nobody else's to place
            raise ValueError(
                "--placement-lease (coordinators sharing expert servers) cannot be combined with "
                f"experts in the coordinator's process ({LOCAL!r}): give the GPU experts to a gpu-server"
            )
        if self.gpu_prefill_token_threshold and not self.gpu:
            raise ValueError("--gpu-prefill-token-threshold needs a GPU expert server or experts in process")

    def resolved(self, resolver: dns.Resolver | None = None, wait_s: float = 60.0) -> ClusterConfig:
        """This config with every ``dns:///`` server replaced by one server per address it
        resolves to now (``ServerSpec.dns`` keeps the name), all servers then named by position
        per kind as listed ones are (gpu0, gpu1, ..., cpu0, ...). A name that resolves to
        nothing is retried for ``wait_s``, then ValueError."""
        names = [dns.parse(s.address) for s in self.servers]
        if not any(names):
            return self
        resolver = resolver or dns.resolver_for(self.dns_hosts_file)
        found: list[tuple[str, str, str]] = []  # (kind, address, dns name)
        for spec, name in zip(self.servers, names):
            if spec.in_process:
                continue  # NOTE: 'local' keeps its name and its place (first)
            if name is None:
                found.append((spec.kind, spec.address, ""))
            else:
                found += [(spec.kind, a, str(name)) for a in dns.wait_resolved(name, resolver, wait_s)]
        count = {"gpu": 0, "cpu": 0}
        specs = [s for s in self.servers if s.in_process]
        for kind, address, name_ in found:
            specs.append(ServerSpec(f"{kind}{count[kind]}", address, kind, name_))
            count[kind] += 1
        return replace(self, servers=tuple(specs))

    @property
    def shm_ring_bytes(self) -> int:
        return int(self.shm_ring_mb * (1 << 20)) // 4096 * 4096

    @property
    def gpu(self) -> list[ServerSpec]:
        return [s for s in self.servers if s.kind == "gpu"]

    @property
    def cpu(self) -> list[ServerSpec]:
        return [s for s in self.servers if s.kind == "cpu"]

    @property
    def has_local(self) -> bool:
        return any(s.in_process for s in self.servers)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("expert servers")
        g.add_argument(
            "--gpu-server",
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="repeatable; dns:///NAME:PORT = one server per address NAME resolves to, re-resolved "
            "every --dns-refresh-s (an address that goes away is drained, a new one replaces it)",
        )
        g.add_argument(
            "--cpu-server",
            action="append",
            default=[],
            metavar="HOST:PORT",
            help="repeatable; as --gpu-server",
        )
        g.add_argument(
            "--dns-refresh-s",
            type=float,
            default=ClusterConfig.dns_refresh_s,
            help="seconds between two resolutions of the dns:/// expert server names",
        )
        g.add_argument(
            "--dns-hosts-file",
            default=None,
            metavar="FILE",
            help="hosts-format file (IP NAME...) consulted before DNS for the dns:/// names, re-read "
            "at every resolution",
        )
        g.add_argument(
            "--num-gpu-experts",
            type=int,
            default=None,
            help="logical ids < N on GPU servers; with --cpu-server and no --gpu-server: in this "
            "process (the cluster member 'local', on --device), the rest on the CPU servers",
        )
        g.add_argument(
            "--placement", default=None, metavar="FILE", help="JSON placement (see expertmesh/placement.py)"
        )
        g.add_argument(
            "--replica-policy",
            default=ClusterConfig.replica_policy,
            choices=list(REPLICA_POLICIES),
            help="which replica of an expert gets a token: the first, in turn, or the least loaded server's",
        )
        g.add_argument(
            "--gpu-prefill-token-threshold",
            type=int,
            default=ClusterConfig.gpu_prefill_token_threshold,
            help="steps with >= T tokens run every expert on the first GPU server, or in this process "
            "with 'local' (which then holds every expert's weights too); 0 = off",
        )
        g.add_argument(
            "--expert-timeout",
            type=float,
            default=ClusterConfig.timeout_s,
            help="seconds before an expert server is declared failed",
        )
        g.add_argument(
            "--transport",
            default=ClusterConfig.transport,
            choices=list(negotiate.CHOICES),
            help="data path to the expert servers: auto = the fastest both sides offer (shared memory on "
            "this host, tcp to other hosts); tcp = binary frames on a TCP connection of their own; shm / "
            "cuda_ipc = require shared memory / CUDA IPC (same host / same GPU); grpc = plain gRPC",
        )
        g.add_argument(
            "--server-data-address",
            action="append",
            default=[],
            metavar="SERVER=HOST:PORT",
            help="reach SERVER's TCP data path (SERVER: its --gpu-server/--cpu-server address or its "
            "name, gpu0, cpu1, ...) at HOST:PORT instead of the port it advertises (repeatable)",
        )
        g.add_argument(
            "--shm-ring-mb",
            type=float,
            default=ClusterConfig.shm_ring_mb,
            help="shared-memory ring per expert server; larger payloads go over gRPC",
        )
        g.add_argument(
            "--shm-spin-us",
            type=float,
            default=cores.default_spin_us(),
            help="fast paths: poll this long for an answer before sleeping (0 = always sleep; "
            "default: %(default)g here, 0 unless there are more cores than the 3 processes of a cluster)",
        )
        g.add_argument(
            "--cpu-defer-experts",
            type=int,
            default=ClusterConfig.cpu_defer_experts,
            metavar="N",
            help="CHANGES RESULTS: each token's N lowest-weight experts on CPU servers are added one layer "
            "later, so CPU work overlaps the next layer (KTransformers-style; coordinator/model/deferral.py); 0 = off",
        )
        g.add_argument(
            "--placement-lease",
            type=float,
            default=ClusterConfig.placement_lease_s,
            metavar="SECONDS",
            help="several coordinators share these expert servers: one at a time places experts, by a "
            "lease of SECONDS on the servers (renewed; another takes over that long after it dies); "
            "the others follow its placement. 0 = off (this coordinator alone places experts)",
        )
        g.add_argument(
            "--cluster-token",
            default=None,
            help=f"secret the expert servers require for placement pushes (or env {auth.CLUSTER_TOKEN_ENV})",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterConfig:
        data = data_addresses(getattr(args, "server_data_address", []))
        servers = [ServerSpec.local()] if wants_local(args) else []
        servers += [ServerSpec(f"gpu{i}", a, "gpu") for i, a in enumerate(args.gpu_server)]
        servers += [ServerSpec(f"cpu{i}", a, "cpu") for i, a in enumerate(args.cpu_server)]
        unknown = set(data) - {s.name for s in servers} - {s.address for s in servers}
        if unknown:
            raise ValueError(f"--server-data-address names no expert server: {sorted(unknown)}")
        servers = [replace(s, data_address=data.get(s.name) or data.get(s.address) or "") for s in servers]
        return cls(
            servers=tuple(servers),
            num_gpu_experts=args.num_gpu_experts,
            placement_file=args.placement,
            replica_policy=args.replica_policy,
            gpu_prefill_token_threshold=args.gpu_prefill_token_threshold,
            timeout_s=args.expert_timeout,
            transport=args.transport,
            shm_ring_mb=args.shm_ring_mb,
            shm_spin_us=args.shm_spin_us,
            cluster_token=args.cluster_token or auth.token_from_env(auth.CLUSTER_TOKEN_ENV),
            tls=TLSConfig.from_args(args),
            cpu_defer_experts=args.cpu_defer_experts,
            dns_refresh_s=args.dns_refresh_s,
            dns_hosts_file=args.dns_hosts_file,
            placement_lease_s=args.placement_lease,
        )


def wants_local(args: argparse.Namespace) -> bool:
    """Whether the coordinator holds experts itself: ``--num-gpu-experts N`` (N > 0) with CPU
    servers and no GPU server, or a placement file that names ``local``."""
    if args.placement:
        return LOCAL in pl.file_server_names(args.placement)
    return bool(args.num_gpu_experts) and bool(args.cpu_server) and not args.gpu_server


def data_addresses(items: list[str]) -> dict[str, str]:
    """``--server-data-address SERVER=HOST:PORT`` flags -> {SERVER: HOST:PORT}."""
    out = {}
    for item in items:
        server, sep, address = item.partition("=")
        if not sep or not server:
            raise ValueError(f"--server-data-address {item!r}: expected SERVER=HOST:PORT")
        split_address(address)
        out[server] = address
    return out
