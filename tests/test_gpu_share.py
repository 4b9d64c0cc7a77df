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
    assert "2 processes run kernels on this GPU" in probe.shared()
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


def test_a_background_probe_refreshes_off_the_caller_and_ends_with_the_probe():
    import gc
    import threading

    counts = [1]
    probe = ShareProbe(lambda: counts[0], ttl_s=0.05, background=True)
    assert probe.shared() == ""  # the first answer is counted there and then
    thread = probe._thread
    assert thread is not None and thread.is_alive()
    counts[0] = 3
    deadline = time.monotonic() + 5
    while not probe.shared() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "3 processes" in probe.shared(), "the thread did not refresh the answer"
    del probe
    gc.collect()
    thread.join(5)
    assert not thread.is_alive() and all(t is not thread for t in threading.enumerate())


def test_a_paused_link_says_why_in_the_status_until_a_step_links():
    """A step of a live link that ran without it (here: the GPU shared) leaves its reason on
    the connection, and the server's status shows it instead of the offer's note."""
    from types import SimpleNamespace

    from coordinator.experts.cluster import ExpertCluster, ServerState
    from coordinator.model.remote_graphs import RemoteDecodeGraphs

    conn = SimpleNamespace(spec=SimpleNamespace(name="gpu0", address="a:1", kind="gpu"), info=None)
    conn.link_note, conn.link_pause = "", ""
    graphs = SimpleNamespace(_link_note="")
    RemoteDecodeGraphs._note(graphs, conn, "2 processes run kernels on this GPU")
    assert conn.link_pause == graphs._link_note == "2 processes run kernels on this GPU"
    cluster = SimpleNamespace(
        members=[SimpleNamespace(conn=conn, state=ServerState.READY, last_error="")],
        tables=SimpleNamespace(slots=[]),
    )
    (info,) = ExpertCluster.server_infos(cluster)
    assert info["link_note"] == "2 processes run kernels on this GPU"
    conn.link_pause = ""  # what a linked step does
    (info,) = ExpertCluster.server_infos(cluster)
    assert info["link_note"] == ""


def _busy(seconds: float) -> None:
    import torch

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.cuda._sleep(5_000_000)  # a kernel that spins ~ms: SM utilisation above 0
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_nvml_counts_a_second_busy_process_on_the_gpu():
    """NVML's per-process samples: this process busy alone is one; a second process running
    kernels on the GPU makes two (shared); one that only holds a context does not count."""
    from expertmesh.net import device_uuid

    probe = ShareProbe.for_device(device_uuid("cuda:0"), ttl_s=0)
    assert probe._count is not None, "NVML not found on a GPU host"
    prog = (
        "import sys, time, torch; torch.zeros(1, device='cuda:0'); print(1, flush=True)\n"
        "while sys.argv[1] == 'busy': torch.cuda._sleep(5_000_000); torch.cuda.synchronize()\n"
        "time.sleep(60)"
    )
    for what, want in (("idle", 1), ("busy", 2)):
        other = subprocess.Popen([sys.executable, "-c", prog, what], stdout=subprocess.PIPE)
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == b"1"
            _busy(2.0)
            assert probe._count() == want, what
            assert bool(probe.shared()) == (want == 2), what
        finally:
            other.kill()
            other.wait()
