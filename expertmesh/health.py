"""``expertmesh health --addr HOST:PORT``: exit 0 iff the server reports SERVING.

Every expertmesh server answers two kinds of grpc.health.v1 names: the overall status ``""``
(and the served services' names), SERVING only while the server can do its work (weights
loaded, not draining; for a coordinator: every expert has a live replica), and
:data:`LIVENESS`, SERVING from the moment the port is bound until shutdown. An orchestrator's
readiness check asks the first, its liveness check the second, so that a coordinator whose expert
servers are down, or a server still loading, is kept out of traffic without being restarted.
"""

from __future__ import annotations

import argparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.tls import TLSConfig, channel

LIVENESS = "liveness"


def check(addr: str, timeout: float = 3.0, service: str = "", tls: TLSConfig | None = None) -> str:
    """Returns the status name (SERVING, NOT_SERVING, ...) or UNREACHABLE."""
    with channel(addr, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", required=True, help="HOST:PORT")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument(
        "--service",
        default="",
        help=f"health name to ask: '' = ready to serve (default), '{LIVENESS}' = the process answers",
    )
    TLSConfig.add_arguments(p, "client")


def run(args: argparse.Namespace) -> int:
    status = check(args.addr, args.timeout, args.service, tls=TLSConfig.from_args(args))
    print(status)
    return 0 if status == "SERVING" else 1
