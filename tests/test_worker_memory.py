"""Host memory advice for expert weights (expertmesh/worker/memory.py): a new layer's weights
ask for transparent huge pages before their pages are faulted in."""

from __future__ import annotations

from pathlib import Path

import torch

from expertmesh.worker import memory


def vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_huge_pages_marks_the_weights_mapping():
    t = torch.empty(64 << 20, dtype=torch.uint8)  # well past malloc's mmap threshold: its own mapping
    assert "hg" not in vm_flags(t.data_ptr() + (32 << 20))
    assert memory.huge_pages(t)
    assert "hg" in vm_flags(t.data_ptr() + (32 << 20))
    t.fill_(1)  # the pages fault in after the advice
    assert int(t[::4096].sum()) == t[::4096].numel()


def test_huge_pages_leaves_what_it_cannot_advise():
    assert not memory.huge_pages(torch.empty(8, 8).t())  # not contiguous
    assert not memory.huge_pages(torch.empty(0))  # no whole page
