"""The probe that stands an ``auto`` link down while other processes compute on its GPU
(expertmesh/gpu_share.py): its rule and cache with a stand-in counter everywhere, and NVML's
count on a real GPU (``gpu``) with a second process holding a context there."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from expertmesh.gpu_share import ShareProbe


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_two_processes_are_shared_one_is_not_and_the_answer_is_cached():
    counts, asked, clock = [1], [], Clock()

    def count() -> int:
        asked.append(clock.t)
        return counts[0]

    probe = ShareProbe(count, ttl_s=2.0, clock=clock)
    assert probe.shared() == ""
    counts[0] = 2
    clock.t = 1.0
    assert probe.shared() == "", "asked again inside its ttl"
    clock.t = 2.5
    assert "2 processes compute on this GPU" in probe.shared()
    clock.t = 3.0
    counts[0] = 1
    assert probe.shared() != "", "the cached answer stands until the ttl ends"
    clock.t = 5.0
    assert probe.shared() == "", "the other process went: the link comes back"
    assert asked == [0.0, 2.5, 5.0]


def test_a_failing_count_is_not_shared_and_a_missing_nvml_never_is():
    def broken() -> int:
        raise OSError("NVML GetComputeRunningProcesses returned 999")

    assert ShareProbe(broken, ttl_s=0).shared() == ""
    assert ShareProbe(None).shared() == ""


@pytest.mark.gpu
def test_nvml_counts_a_second_process_on_the_gpu():
    import torch

    from expertmesh.net import device_uuid

    torch.zeros(1, device="cuda:0")  # this process's context
    probe = ShareProbe.for_device(device_uuid("cuda:0"), ttl_s=0)
    assert probe._count is not None, "NVML not found on a GPU host"
    base = probe._count()
    assert base >= 1
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, time; torch.zeros(1, device='cuda:0'); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        assert probe._count() == base + 1
        assert probe.shared() != ""
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while probe._count() > base and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe._count() == base
