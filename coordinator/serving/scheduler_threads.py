"""How many intra-op threads a step gets on the CPU: a small step runs on one.

A forward step is hundreds of torch ops. On the CPU an op forks the OpenMP team and ends at
its barrier; the ops of a decode step or a short prefill chunk of a small model do microseconds
of work each, so the fork and the barrier are the cost, and while another process holds a core
the barrier waits for the descheduled thread's next time slice. Measured on the shared 2-core
VM with the demo model (hidden 128), one thread against two: a decode step of 4 sequences
5.2 ms against 8.5 ms on a quiet host and 5-14 ms against 25-52 ms on a busy one; a 512-token
prefill 52-71 ms against 44-50 ms (there two threads win). At real widths (hidden 2048) two
threads already win on a quiet host from a few decode tokens on (0.8-0.9x the time of one).

So a step whose work, tokens x hidden size, is under ``SMALL_STEP_WORK`` (256 tokens at hidden
128, 16 at hidden 2048) runs on one thread, larger steps on the process's threads (``--threads``).
Prefix caching makes most steps of a chat small (a cached turn computes only its new message),
which is where this pays most. CUDA steps are not touched (their host threads only launch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SMALL_STEP_WORK = 1 << 15  # tokens x hidden size below which a CPU step runs on one thread


class StepThreads:
    """Sets the calling thread's torch intra-op threads for each step.

    ``threads``: the process's count (default: the constructing thread's, i.e. ``--threads``).
    It is set on the scheduler thread explicitly rather than inherited: torch starts a new
    thread with the count last set by any thread (a checkpoint reader pool sets one for its
    own threads), not with the one the process was configured with."""

    def __init__(
        self,
        device: torch.device,
        hidden_size: int,
        small_work: int = SMALL_STEP_WORK,
        threads: int | None = None,
    ) -> None:
        assert hidden_size > 0 and small_work >= 0, f"{hidden_size=} {small_work=}"
        self.cpu = device.type == "cpu"
        self.hidden_size, self.small_work = hidden_size, small_work
        self.configured = threads if threads is not None else torch.get_num_threads()
        assert self.configured >= 1, f"{self.configured=}"

    def threads(self, tokens: int) -> int:
        """Threads for a step of ``tokens`` tokens."""
        if self.cpu and tokens * self.hidden_size < self.small_work:
            return 1
        return self.configured

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Runs the body with this step's thread count; after a small step the configured count
        is set again, so that threads torch starts later do not inherit the one."""
        if not self.cpu:
            yield
            return
        n = self.threads(tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        try:
            yield
        finally:
            if n != self.configured:
                torch.set_num_threads(self.configured)
