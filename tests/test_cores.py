"""Core shares of ``expertmesh up``'s processes and the fast paths' spin rule (the
defaults on a 2-core machine oversubscribed it five times over)."""

from __future__ import annotations

import argparse

import pytest

from coordinator.experts.cluster_config import ClusterConfig
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


# ---------------------------------------------------------------- cgroup CPU quotas


def _tree(base, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup tree under ``base`` (made here)."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "proc_cgroup").write_text(proc)
    root = base / "cg"
    root.mkdir()
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(root), str(base / "proc_cgroup")


@pytest.mark.parametrize(
    "proc, files, quota",
    [
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),  # v2 in a container's namespace
        # v2 from the host's view: the tightest of the process's cgroup and its parents
        ("0::/a/b\n", {"a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000"}, 2.0),
        ("0::/a/b\n", {"a/cpu.max": "400000 100000", "a/b/cpu.max": "300000 100000"}, 3.0),
        ("0::/\n", {}, None),  # no cpu controller file at all
        ("0::/\n", {"cpu.max": "garbage"}, None),
        # v1 (cpu,cpuacct hierarchy), -1 = none
        (
            "4:cpu,cpuacct:/docker/x\n1:memory:/\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "-1",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
            },
            None,
        ),  # fmt: skip
        (
            "4:cpu,cpuacct:/docker/x\n",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
            },
            0.5,
        ),  # fmt: skip
        # v1 seen from inside the container: the path names the host's cgroup, the mount is ours
        (
            "4:cpu:/kubepods/pod1\n",
            {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"},
            3.0,
        ),
    ],
)
def test_cgroup_quota(tmp_path, proc, files, quota):
    root, proc_file = _tree(tmp_path, proc, files)
    assert cores.cgroup_quota(root, proc_file) == quota


def test_available_takes_the_quota_and_the_mask(tmp_path, monkeypatch):
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(16)))
    tree = _tree(tmp_path / "a", "0::/\n", {"cpu.max": "250000 100000"})
    assert cores.available(*tree) == 2  # 2.5 cores of quota: two busy threads fit
    tree = _tree(tmp_path / "b", "0::/\n", {"cpu.max": "50000 100000"})
    assert cores.available(*tree) == 1  # half a core: still one thread
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    tree = _tree(tmp_path / "c", "0::/\n", {"cpu.max": "800000 100000"})
    assert cores.available(*tree) == 2  # the mask is tighter
    assert cores.available(str(tmp_path / "none"), str(tmp_path / "no_proc")) == 2  # nothing readable


def test_io_threads_are_bounded():
    assert [cores.io_threads(n) for n in (1, 2, 4, 64)] == [2, 2, 4, 8]


def test_the_event_loop_gets_a_bounded_executor_once():
    import asyncio

    async def threads_used() -> set[str]:
        cores.cap_default_executor(3)
        cores.cap_default_executor(7)  # a second server in the same loop keeps the first cap
        names = await asyncio.gather(
            *[asyncio.to_thread(lambda: __import__("threading").current_thread().name) for _ in range(20)]
        )
        return set(names)

    names = asyncio.run(threads_used())
    assert names and all(n.startswith("io") for n in names) and len(names) <= 3, names


def test_long_spin_only_on_big_machines():
    assert cores.default_spin_us(15) == cores.SPIN_US
    assert cores.default_spin_us(16) == cores.LONG_SPIN_US > cores.SPIN_US
    assert cores.default_spin_us(64) == cores.LONG_SPIN_US
