"""How many CPU cores a process may use, and how the processes of one host share them.

Why: ``expertmesh up`` runs three processes (coordinator, GPU and CPU expert servers) that each
used torch's default thread pools (one thread per core) and polled for fast-path answers. On a
2-core machine that is six compute threads plus spinning waiters on two cores: decode ran at a
fifth of the speed of ``--threads 1`` (``benchmarks/RESULTS.md``, issue 10b). The rules here
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


def available() -> int:
    """Cores this process may run on (its affinity mask: what taskset, cgroups' cpusets and
    container runtimes restrict; ``os.cpu_count()`` would count the whole host)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_spin_us(cores: int | None = None, busy: int = LOCAL_PROCESSES) -> float:
    """The fast paths' spin budget: ``SPIN_US`` when there are more cores than processes that
    may be busy at once, else 0 (sleep at once). A waiter that spins on a core that another
    process of the cluster needs delays the very answer it waits for."""
    cores = available() if cores is None else cores
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
