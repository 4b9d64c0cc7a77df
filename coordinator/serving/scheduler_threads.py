"""How many intra-op threads a step gets on the CPU: a small step runs on one.

A forward step is hundreds of torch ops. On the CPU an op forks the OpenMP team and ends at
its barrier; the ops of a decode step or a short prefill chunk of a small model do microseconds
of work each, so the fork and the barrier are the cost, and while another process holds a core
the barrier waits for the descheduled thread's next time slice. Measured on the shared 2-core
VM with the demo model (hidden 128), one thread against two: a decode step of 4 sequences
5.2 ms against 8.5 ms on a quiet host and 5-22 ms against 25-350 ms on a busy one; a 512-token
prefill 52-71 ms against 44-48 ms (quiet: there two threads win). At real widths (hidden 2048) two
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
    """Picks and sets the calling thread's torch intra-op threads for one step."""

    def __init__(self, device: torch.device, hidden_size: int, small_work: int = SMALL_STEP_WORK) -> None:
        assert hidden_size > 0 and small_work >= 0, f"{hidden_size=} {small_work=}"
        self.cpu = device.type == "cpu"
        self.hidden_size, self.small_work = hidden_size, small_work

    def threads(self, tokens: int, configured: int) -> int:
        """Threads for a step of ``tokens`` tokens, given the process's ``configured`` count."""
        if self.cpu and tokens * self.hidden_size < self.small_work:
            return 1
        return configured

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Runs the body with this step's thread count, then restores the count it found.

        NOTE: torch.set_num_threads sets the calling thread's OpenMP and MKL counts, and the
        default a thread that has not used torch's pool yet starts with: the scheduler thread
        restores it after every step, so only a thread whose first parallel torch op falls
        inside a small step could start on one thread."""
        configured = torch.get_num_threads()
        n = self.threads(tokens, configured)
        if n == configured:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(configured)
