"""One CPU expert server over several NUMA nodes (``cpu-server --numa-node all``): each node
holds a contiguous run of every layer's slots in its own memory and computes them with its own
thread group, the groups run concurrently, and their partial outputs are summed.

Shapes: T tokens, K top-k, S local slots of a layer, H hidden.

- Plan (cpu_expert_server/numa.py): ``plan_groups`` gives node n a group of ``threads_n``
  threads on its allowed CPUs; ``split_slots(S)`` gives it slots ``[a_n, b_n)`` of every layer,
  balanced by bytes. A pure function of S, so the stacking and every forward agree.
- Threads: each group has one dispatcher thread pinned to its node's CPUs; the C kernels' OpenMP
  team and torch's intra-op team are started from it, so they inherit the pin (Linux threads
  inherit their creator's mask); the kernels get ``threads_n``, torch's per-thread OpenMP count
  is set to it. The groups' threads add up to the allowed CPUs (or ``--threads``): no core runs
  two teams.
- Memory: the slot table stacks a layer's packed slots through :meth:`stack_slots` (at load and
  at every placement prepare, off the request path; an EPLB push re-stacks every layer, reused
  experts included, so each push re-places them at no extra cost). Node n's run is
  ``MPOL_PREFERRED`` on n (cpu_expert_server/numa_memory.py; tensors of MBIND_MIN_BYTES or more)
  and is copied in by a thread pinned to n, so its pages are node-local by first touch even
  where the kernel refuses the policy call (logged once). Tensors that did not come through the
  slot table (a direct caller) are split the same way but left where they are.
- Compute: a forward sends each group the tokens with a slot in its run (ids shifted to the
  run, -1 elsewhere) and the views ``w13[a:b], w2[a:b]``; the partial sums are added in float32
  and rounded once to x's dtype (bf16: within one rounding of the one-call result).

Not balanced: load. A run of hot experts makes its node the slow one (the coordinator's EPLB
balances servers, not the nodes inside one); one server per node (``--numa-node K``) lets EPLB
balance the nodes too.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cpu_expert_server import numa, numa_memory
from cpu_expert_server.backend import CpuExpertBackend, group_text
from expertmesh.experts import ExpertBackend
from expertmesh.lora.moe import LoRABatch, MoELoRAWeights

log = logging.getLogger("expertmesh.cpu_numa")

# NOTE: glibc serves allocations of 32 MiB and more (its largest mmap threshold) from their own
# mappings, unmapped when freed, so their policy dies with them; a smaller tensor sits in a heap
# that outlives it, where each mbind would leave a policy and a VMA split behind (a server that
# takes thousands of placement pushes could run into vm.max_map_count): first touch only there
MBIND_MIN_BYTES = 32 << 20
LOCAL_WARN = 0.9  # warn when less of a node's run than this reads back as on the node
# set, these make OpenMP bind its threads from the process's initial mask, overriding the pins
OMP_BIND_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def _thread_state() -> tuple[list[int], int]:
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


class GroupThread:
    """A node group's dispatcher: one thread pinned to the group's CPUs that runs the calls sent
    to it in order. SimpleQueues, not an executor: a call's round trip measured 17 us against an
    executor's 73 us on the 2-core machine (median, one group)."""

    def __init__(self, group: numa.NodeGroup) -> None:
        self.group = group
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"numa{group.node}", daemon=True)
        self._thread.start()
        self.result()  # started and pinned, or the OSError of the pin raised here

    def _loop(self) -> None:
        try:
            os.sched_setaffinity(0, set(self.group.cpus))  # pid 0: this thread only
        except OSError as e:  # a CPU gone offline, a cpuset changed since the plan was read
            self._done.put((None, e))
            return
        # NOTE: a thread's first torch.get_num_threads() sets its OpenMP count from torch's global
        # one; set_num_threads after it sticks for this thread (the backend restores the global
        # value once every group has started)
        torch.get_num_threads()
        torch.set_num_threads(self.group.threads)
        self._done.put((None, None))
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                self._done.put((fn(*args), None))
            except Exception as e:  # noqa: BLE001 - the thread's boundary: raised on the caller's thread
                self._done.put((None, e))

    def submit(self, fn: Callable, *args: object) -> None:
        self._jobs.put((fn, args))

    def answer(self) -> tuple[Any, Exception | None]:
        """The oldest submitted call's (value, None), or (None, the exception it raised)."""
        return self._done.get()

    def result(self) -> Any:
        value, err = self.answer()
        if err is not None:
            raise err
        return value

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class NumaExpertBackend(ExpertBackend):
    """The CPU backend split over node groups (see the module docstring)."""

    name = "cpu"

    def __init__(
        self,
        groups: list[numa.NodeGroup],
        weight_dtype: str = "bfloat16",
        make: Callable[[int], CpuExpertBackend] | None = None,
        mbind_min_bytes: int = MBIND_MIN_BYTES,
        group: int | None = None,
    ) -> None:
        """``make(threads)``: one group's CPU backend (default: CpuExpertBackend with the group's
        thread count, ``weight_dtype`` and quantisation ``group``); ``mbind_min_bytes``: stacked
        tensors below it are placed by first touch only (see MBIND_MIN_BYTES)."""
        assert len(groups) >= 2, f"one group is the plain backend: {groups=}"
        make = make or (lambda n: CpuExpertBackend(n, weight_dtype, group=group, kernel_thread=False))
        self.groups = groups
        self.inner = [make(g.threads) for g in groups]
        self.weight_dtype = self.inner[0].weight_dtype
        self.threads = sum(g.threads for g in groups)
        # node -> (pages on the node, pages read back) of the last stacked layer
        self.placed: dict[int, tuple[int, int]] = {}
        self._warned: set[str] = set()
        self.mbind_min_bytes = mbind_min_bytes
        bound = [k for k in OMP_BIND_ENV if os.environ.get(k)]
        if bound:
            log.warning("%s set: OpenMP may bind the groups' threads off their nodes", ", ".join(bound))
        global_threads = torch.get_num_threads()
        # NOTE: one caller at a time: answers pair with calls by order in each group's queue
        self._lock = threading.Lock()
        self._threads = [GroupThread(g) for g in groups]
        self.thread_state()  # every group thread has set its OpenMP count before the restore
        torch.set_num_threads(global_threads)

    def thread_state(self) -> list[tuple[list[int], int]]:
        """Each group thread's (CPUs, torch threads), read on that thread."""
        with self._lock:
            for g in self._threads:
                g.submit(_thread_state)
            return [g.result() for g in self._threads]

    def close(self) -> None:
        for g in self._threads:
            g.close()

    # -- weights ---------------------------------------------------------------------------------
    def pack_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = self.inner[0].pack_weights(w13, w2)
        for b in self.inner[1:]:  # every group's backend learns the packed format (no slot packed twice)
            b.pack_weights(w13[:0], w2[:0])
        return packed

    def stack_slots(
        self, w13: list[torch.Tensor], w2: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot table's stacking of a layer's packed slots ([2I, row13] and [H, row2] each)
        into [S, 2I, row13], [S, H, row2], each group's run in its node's memory."""
        s = len(w13)
        if s == 0:
            return torch.stack(w13), torch.stack(w2)
        out13 = torch.empty((s, *w13[0].shape), dtype=w13[0].dtype)
        out2 = torch.empty((s, *w2[0].shape), dtype=w2[0].dtype)

        def fill(g: numa.NodeGroup, a: int, b: int) -> str | None:
            """Node g's run: policy, then first touch from g's CPUs; the policy's refusal or None."""
            os.sched_setaffinity(0, set(g.cpus))  # this (short-lived) thread only
            refused = None
            for full, t in ((out13, out13[a:b]), (out2, out2[a:b])):
                if full.numel() * full.element_size() < self.mbind_min_bytes:
                    continue
                try:
                    numa_memory.prefer_node(t.data_ptr(), t.numel() * t.element_size(), g.node)
                except numa_memory.NumaMemoryError as e:
                    refused = str(e)
            torch.stack(w13[a:b], out=out13[a:b])
            torch.stack(w2[a:b], out=out2[a:b])
            return refused

        # NOTE: short-lived threads, not the group threads: a placement prepare runs while requests
        # flow, and a layer's copy would hold up the group's forwards behind it
        runs = list(zip(self.groups, numa.split_slots(s, self.groups), strict=True))
        with cf.ThreadPoolExecutor(len(runs), "numa-place") as pool:
            jobs = {g.node: pool.submit(fill, g, a, b) for g, (a, b) in runs if b > a}
            cf.wait(jobs.values())
        refused = {node: j.result() for node, j in jobs.items()}  # raises a copy's error here
        for node, why in refused.items():
            if why is None:
                continue
            self._warn_once(
                f"refused:{node}:{why}",
                f"NUMA memory policy refused for node {node} ({why}): its experts are placed by "
                "first touch from its pinned threads only",
            )
        self._read_back(out13, out2, runs)
        return out13, out2

    def _read_back(self, out13, out2, runs) -> None:
        placed = {}
        for g, (a, b) in runs:
            if b == a:
                continue
            try:
                where = [n for t in (out13[a:b], out2[a:b]) for n in self._where(t)]
            except numa_memory.NumaMemoryError as e:
                self._warn_once(f"query:{e}", f"cannot read back where expert pages are ({e})")
                return
            placed[g.node] = (sum(n == g.node for n in where), len(where))
        if not self.placed:  # the first layer stacked: say where it went
            log.info(
                "expert pages on their own node (sampled, first layer): %s",
                ", ".join(f"node {n}: {loc}/{tot}" for n, (loc, tot) in placed.items()),
            )
        self.placed = placed
        for node, (local, total) in placed.items():
            if total and local < LOCAL_WARN * total:
                self._warn_once(
                    f"local:{node}",
                    f"node {node}: {local} of {total} sampled expert pages read back on the node",
                )

    @staticmethod
    def _where(t: torch.Tensor) -> list[int]:
        return numa_memory.where_are(t.data_ptr(), t.numel() * t.element_size())

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

    # -- compute ---------------------------------------------------------------------------------
    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        t, s = x.shape[0], w13.shape[0]
        if t == 0 or s == 0:
            return torch.zeros_like(x)
        # NOTE: numpy for the id arithmetic: on these few numbers its ops cost a fraction of
        # torch's per-op overhead, which a decode step pays per layer
        ids = slot_ids.numpy()  # [T, K]
        # NOTE: checked here: an id beyond every run would be -1 in each group, silently dropped
        if ids.min() < -1 or ids.max() >= s:
            raise ValueError(f"slot ids outside [-1, {s})")
        with self._lock:
            outs = self._run_groups(x, w13, w2, ids, weights, lora)  # [T, H] each
        if not outs:
            return torch.zeros_like(x)
        if len(outs) == 1:
            return outs[0]
        acc = outs[0].float()
        for o in outs[1:]:
            acc += o.float()
        return acc.to(x.dtype)

    def _run_groups(self, x, w13, w2, ids: np.ndarray, weights, lora) -> list[torch.Tensor]:
        """Each group with a pair in its run computes those pairs; their [T, H] answers."""
        sent = []
        for group, inner, (a, b) in zip(
            self._threads, self.inner, numa.split_slots(w13.shape[0], self.groups), strict=True
        ):
            mine = (ids >= a) & (ids < b)  # [T, K]
            if b == a or not mine.any():
                continue
            local = torch.from_numpy(np.where(mine, ids - a, -1).astype(ids.dtype))  # [T, K] ids in the run
            sub = None if lora is None else _lora_run(lora, a, b)
            group.submit(inner.forward, x, w13[a:b], w2[a:b], local, weights, sub)
            sent.append(group)
        # NOTE: every group's answer is collected before anything is raised: a group's queue then
        # holds no stale answer for the next call
        done = [g.answer() for g in sent]
        errs = [e for _, e in done if e is not None]
        if errs:
            raise errs[0]
        return [o for o, _ in done]


def _lora_run(lora: LoRABatch, a: int, b: int) -> LoRABatch:
    """The LoRA buffers of slots [a, b) (views)."""
    w = lora.weights
    return LoRABatch(
        MoELoRAWeights(w.a13[:, a:b], w.b13[:, a:b], w.a2[:, a:b], w.b2[:, a:b]), lora.token_adapter
    )


def make_numa_backend(
    groups: list[numa.NodeGroup], weight_dtype: str = "bfloat16", group: int | None = None
) -> NumaExpertBackend:
    backend = NumaExpertBackend(groups, weight_dtype, group=group)
    b0 = backend.inner[0]
    log.info(
        "CPU experts over %d NUMA nodes: weights %s%s, %s; decode kernel %s, prefill %s",
        len(groups), weight_dtype, group_text(weight_dtype, group),
        "; ".join(f"node {g.node}: {g.threads} threads on CPUs {numa.cpulist(g.cpus)}" for g in groups),
        "C" if b0.lib is not None else "torch (fallback)",
        "AMX kernel (bf16 servers)" if b0.amx else f"torch GEMM in {b0.gemm_dtype}",
    )  # fmt: skip
    return backend
