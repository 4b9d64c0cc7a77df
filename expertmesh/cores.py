"""How many CPU cores a process may use, and how the processes of one host share them.

Why: ``expertmesh up`` runs three processes (coordinator, GPU and CPU expert servers) that each
used torch's default thread pools (one thread per core) and polled for fast-path answers. On a
2-core machine that is six compute threads plus spinning waiters on two cores: decode ran at a
fifth of the speed of ``--threads 1`` (``benchmarks/RESULTS.md``). The rules here
give each process its own share of the cores and spin only when a core is free to spin on.
"""

from __future__ import annotations

import contextlib
import os

# coordinator + GPU expert server + CPU expert server: the processes of ``expertmesh up``, all
# runnable at once (two servers computing while the coordinator waits, or the coordinator
# computing while both servers wait for the next layer)
LOCAL_PROCESSES = 3
SPIN_US = 300.0  # fast paths' poll before sleeping, when cores allow it
LONG_SPIN_US, LONG_SPIN_CORES = 2000.0, 16  # ... and when a core for each waiter is cheap
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def available(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """Cores this process may use: its affinity mask (what taskset and cpusets restrict;
    ``os.cpu_count()`` would count the whole host), lowered to its cgroup's CPU quota (what
    ``docker --cpus`` and Kubernetes CPU limits set while leaving every core in the mask), at
    least 1."""
    try:
        mask = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        mask = os.cpu_count() or 1
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        # NOTE: rounded down: a 1.5-core quota throttles a second busy thread half of the time
        mask = min(mask, int(quota))
    return max(1, mask)


def cgroup_quota(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (quota / period; the tightest of its
    ancestors), None when there is none or it cannot be read. cgroup v2: ``cpu.max``
    ("max 100000" or "200000 100000"); v1: ``cpu.cfs_quota_us`` (-1 = none) over
    ``cpu.cfs_period_us`` in the ``cpu`` controller's hierarchy."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: float | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            dirs = [cgroup_root]
            read = _v2_quota
        elif "cpu" in controllers.split(","):
            dirs = [os.path.join(cgroup_root, d) for d in (controllers, "cpu", "cpu,cpuacct")]
            read = _v1_quota
        else:
            continue
        for base in dirs:
            if not os.path.isdir(base):
                continue
            for d in _ancestors(base, path):
                q = read(d)
                if q is not None and (best is None or q < best):
                    best = q
            break
    return best


def _ancestors(base: str, path: str) -> list[str]:
    """``base/path`` and each of its parents up to ``base`` (a container's namespaced view
    shows "/" here, its own limit then sits at ``base``)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(d: str) -> float | None:
    raw = _read(os.path.join(d, "cpu.max"))
    if raw is None:
        return None
    fields = raw.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(d: str) -> float | None:
    q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    if q is None or p is None:
        return None
    try:
        quota, period = int(q), int(p)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def io_threads(cores: int | None = None) -> int:
    """Threads for a server's blocking helpers (asyncio's default executor: tokenizing, file
    reads, admin work): asyncio would start up to ``os.cpu_count() + 4`` (the whole host's
    count, 36+ on a big machine) next to the process's compute threads."""
    cores = available() if cores is None else cores
    return max(2, min(8, cores))


def cap_default_executor(threads: int | None = None) -> None:
    """Gives the running event loop a bounded default executor sized from this process's core
    share (call inside the loop, before the first ``asyncio.to_thread``). gRPC's C-core keeps
    its own pool, which Python cannot size."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop here: the caller's asyncio.run makes its own
        return
    if getattr(loop, "_expertmesh_io_capped", False):  # several servers in one loop (tests)
        return
    if threads is None:  # the process's share: its torch pool as set from --threads (set_torch_threads)
        import torch

        threads = io_threads(min(available(), torch.get_num_threads()))
    n = threads
    loop.set_default_executor(ThreadPoolExecutor(n, thread_name_prefix="io"))
    with contextlib.suppress(AttributeError):  # a loop class without __dict__: capped again next time
        loop._expertmesh_io_capped = True  # type: ignore[attr-defined]


def default_spin_us(cores: int | None = None, busy: int = LOCAL_PROCESSES) -> float:
    """The fast paths' spin budget: ``LONG_SPIN_US`` with ``LONG_SPIN_CORES`` cores or more,
    ``SPIN_US`` when there are more cores than processes that may be busy at once, else 0
    (sleep at once). A waiter that spins on a core that another process of the cluster needs
    delays the very answer it waits for; one that sleeps pays a wake-up per layer on each side.

    Why the long spin: a coordinator and a GPU expert server sharing one GPU take 0.5-0.7 ms
    per layer round trip (two GPU context switches), longer than ``SPIN_US``, so both sides
    slept every layer: 0.73 ms per layer at batch 1 with 300 us, 0.55 ms with 2000 us on the
    lent H100's 16-core host (benchmarks/RESULTS.md). The budget still halves on
    every miss, so a slow or idle peer costs no CPU for long."""
    cores = available() if cores is None else cores
    if cores >= LONG_SPIN_CORES:
        return LONG_SPIN_US
    return SPIN_US if cores > busy else 0.0


def shares(cores: int, gpu_on_cuda: bool) -> dict[str, int]:
    """torch threads per process of ``expertmesh up``, summing to at most ``cores`` (at least one
    each). A GPU server on CUDA only launches kernels: one thread; the coordinator gets the
    remainder of an uneven split (attention, router and sampling run there on every step)."""
    if gpu_on_cuda:
        rest = max(2, cores - 1)
        cpu = max(1, rest // 2)
        return {"coordinator": max(1, rest - cpu), "gpu-server": 1, "cpu-server": cpu}
    each = max(1, cores // LOCAL_PROCESSES)
    coordinator = max(1, cores - 2 * each)
    return {"coordinator": coordinator, "gpu-server": each, "cpu-server": each}


def set_torch_threads(n: int) -> None:
    """Caps this process's torch intra-op and inter-op pools at ``n`` threads. Call it at start,
    before any torch work: the inter-op pool can be sized only once."""
    import torch  # NOTE: here, so that ``expertmesh up``'s parent process never loads torch

    assert n >= 1, f"{n=}"
    torch.set_num_threads(n)
    # NOTE: RuntimeError: the pool already started (an embedding process did torch work first)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(n)
