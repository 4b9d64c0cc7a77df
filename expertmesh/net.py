"""Network and identity helpers both sides use (no gRPC import: option tuples are plain data).

- :func:`grpc_options`: channel/server options (message size limits raised on both ends; no
  ``SO_REUSEPORT``, so a stale server cannot silently share a port).
- :func:`host_id`: the kernel's boot id; equal values = same host (shared-memory fast path).
- :func:`device_uuid`: the GPU's UUID ("" off CUDA); equal values = same GPU (CUDA IPC).
"""

from __future__ import annotations

from pathlib import Path

import torch


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def host_id() -> str:
    """Boot id: two processes with the same value run on the same host (kernel)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID as ``Describe`` reports it ("" off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
