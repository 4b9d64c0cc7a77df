"""Which data path a coordinator uses with one expert server (pure: facts in, choice out).

``requested`` is the coordinator's ``--transport``:

- ``grpc``: tensors inside the gRPC messages, always possible.
- ``tcp``: binary frames on a TCP connection of their own (expertmesh/transport/tcp.py), any
  host; required.
- ``shm``: payloads in a shared-memory ring on this host; required, an error if impossible.
- ``cuda_ipc``: hidden states and outputs stay in GPU memory (CUDA IPC): the GPU both use, or
  two GPUs of the host when the coordinator's reaches the server's by peer access; small
  routing data in the host ring; required.
- ``auto``: the fastest path both sides offer: shared memory / CUDA IPC on the same host,
  tcp otherwise (or when the server offers no shared memory), gRPC when nothing else is offered.

The choice here rests on what the server says in ``Describe`` (its boot id, the fast paths it
offers, its GPU's UUID); the handshake then proves it (the server must open the segment the
coordinator made, and map its GPU memory) and may still answer with a slower path.
"""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("auto", "grpc", "tcp", "shm", "cuda_ipc")
RANK = {"grpc": 0, "tcp": 1, "shm": 2, "cuda_ipc": 3}


class NegotiationError(ValueError):
    """The requested fast path is impossible with this server; the message says why."""


@dataclass(frozen=True)
class Side:
    host_id: str  # boot id ("" = unknown)
    device_uuid: str = ""  # GPU UUID when this side computes on CUDA
    fast_paths: tuple[str, ...] = ()  # offered besides gRPC (the server's; the coordinator's own)
    peers: tuple[str, ...] = ()  # UUIDs of other GPUs this side's GPU addresses by peer access


@dataclass(frozen=True)
class Choice:
    transport: str
    reason: str = ""  # why nothing faster was chosen


def choose(requested: str, coordinator: Side, server: Side, name: str = "the server") -> Choice:
    assert requested in CHOICES, f"{requested=}"
    if requested == "grpc":
        return Choice("grpc", "--transport grpc")
    why_not_tcp = (
        "" if "tcp" in server.fast_paths else f"{name} offers no TCP data path (started with --no-tcp?)"
    )
    if requested == "tcp":
        if why_not_tcp:
            raise NegotiationError(f"--transport tcp is impossible: {why_not_tcp}")
        return Choice("tcp")
    why_not_shm = ""
    if not coordinator.host_id or coordinator.host_id != server.host_id:
        why_not_shm = f"{name} runs on another host (boot id {server.host_id or '?'}, ours {coordinator.host_id or '?'})"
    elif "shm" not in server.fast_paths:
        why_not_shm = f"{name} offers no shared-memory fast path (started with --no-shm?)"
    why_not_cuda = why_not_shm
    if not why_not_cuda:
        if not coordinator.device_uuid:
            why_not_cuda = "the coordinator does not run on CUDA"
        elif "cuda_ipc" not in server.fast_paths or not server.device_uuid:
            why_not_cuda = f"{name} does not compute on CUDA or offers no CUDA IPC"
        elif coordinator.device_uuid != server.device_uuid and server.device_uuid not in coordinator.peers:
            why_not_cuda = (
                f"{name} uses another GPU ({server.device_uuid}, ours {coordinator.device_uuid}) "
                "without peer access from ours"
            )
    if not why_not_cuda and requested in ("auto", "cuda_ipc"):
        return Choice("cuda_ipc")
    if requested == "cuda_ipc":
        raise NegotiationError(f"--transport cuda_ipc is impossible: {why_not_cuda}")
    if not why_not_shm:
        return Choice("shm", why_not_cuda if requested == "auto" else "")
    if requested == "shm":
        raise NegotiationError(f"--transport shm is impossible: {why_not_shm}")
    if not why_not_tcp:
        return Choice("tcp", why_not_shm)
    return Choice("grpc", f"{why_not_shm}; {why_not_tcp}")


def acceptable(requested: str, planned: str, answered: str) -> bool:
    """Whether the server's answer (maybe slower than planned) satisfies ``requested``."""
    return requested == "auto" or RANK[answered] >= RANK[planned]
