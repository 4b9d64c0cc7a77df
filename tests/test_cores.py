"""Core shares of ``expertmesh up``'s processes and the fast paths' spin rule (issue 10: the
defaults on a 2-core machine oversubscribed it five times over)."""

from __future__ import annotations

import argparse

import pytest

from coordinator.cluster_config import ClusterConfig
from expertmesh import cores, launcher
from expertmesh.worker.config import WorkerConfig


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 16, 64])
@pytest.mark.parametrize("cuda", [False, True])
def test_shares_fit_the_cores(n, cuda):
    s = cores.shares(n, cuda)
    assert set(s) == {"coordinator", "gpu-server", "cpu-server"}
    assert min(s.values()) >= 1
    assert sum(s.values()) <= max(n, 3), s  # oversubscribed only where one thread each cannot fit
    if cuda:
        assert s["gpu-server"] == 1
    if n >= 6:
        assert sum(s.values()) >= n - 2, f"{s} leaves cores idle"


def test_spin_only_with_a_core_to_spare():
    assert [cores.default_spin_us(n) for n in (1, 2, 3)] == [0, 0, 0]
    assert cores.default_spin_us(4) == cores.SPIN_US > 0
    assert cores.default_spin_us(4, busy=4) == 0


def test_config_defaults_follow_the_cores(monkeypatch):
    monkeypatch.setattr(cores, "available", lambda: 2)
    assert ClusterConfig(()).shm_spin_us == 0
    assert WorkerConfig("cpu", "m").shm_spin_us == 0
    monkeypatch.setattr(cores, "available", lambda: 8)
    assert ClusterConfig(()).shm_spin_us == cores.SPIN_US
    assert WorkerConfig("cpu", "m").shm_spin_us == cores.SPIN_US


def _children(argv: list[str]) -> dict[str, list[str]]:
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    gpu, cpu, coord = launcher.build_children(p.parse_args(argv), launcher.Path("m"), 16)
    return {"gpu-server": gpu.cmd, "cpu-server": cpu.cmd, "coordinator": coord}


def _flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, cmd
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize(
    "cores_here, argv, threads, spin",
    [
        (2, ["--device", "cpu"], {"coordinator": 1, "gpu-server": 1, "cpu-server": 1}, "0"),
        (12, ["--device", "cpu"], {"coordinator": 4, "gpu-server": 4, "cpu-server": 4}, "300"),
        (
            2,
            ["--device", "cpu", "--threads", "2", "--shm-spin-us", "50"],
            dict.fromkeys(("coordinator", "gpu-server", "cpu-server"), 2),
            "50",
        ),
    ],
)
def test_up_passes_each_child_its_share(monkeypatch, cores_here, argv, threads, spin):
    monkeypatch.setattr(cores, "available", lambda: cores_here)
    for name, cmd in _children(argv).items():
        assert _flag(cmd, "--threads") == str(threads[name]), (name, cmd)
        assert _flag(cmd, "--shm-spin-us") == spin, (name, cmd)
