"""Where a link's request and answer areas keep their words and payloads (expertmesh/transport/link.py
explains the protocol). Both links use it: the device link's areas in GPU memory, the host
link's in the coordinator's shared-memory segment (cpu_expert_server/hostlink.py). No Triton
here: a CPU expert server and a coordinator without a link import only this.

Shapes: R rows, H hidden, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from expertmesh.transport.layout import view

STEP_SPAN = 1024  # > any model's MoE layer count
ERR_TIMEOUT, ERR_BAD_SLOT = 1, 2
ERR_KERNEL = 4  # the host link's kernel refused a layer (answered with zeros): a server fault
ERR_WIRE = 8  # a relayed link's connection failed or carried a bad frame (transport/relay.c)
_WORDS = 256  # bytes of flag/status words at the start of an area (payloads stay 256-aligned)
_ALIGN = 256
HOST_ALIGN = 4096  # each host-link area starts on its own page of the segment


def _aligned(n: int, align: int = _ALIGN) -> int:
    return -(-n // align) * align


def request_bytes(rows: int, hidden: int, top_k: int, dtype: torch.dtype) -> int:
    return _WORDS + _aligned(rows * hidden * dtype.itemsize) + 2 * _aligned(rows * top_k * 4)


def answer_bytes(rows: int, hidden: int, dtype: torch.dtype) -> int:
    return _WORDS + _aligned(rows * hidden * dtype.itemsize)


def host_areas(offset: int, rows: int, hidden: int, top_k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """A host link's (request offset, answer offset, end) in the segment: the request area at
    ``offset`` rounded up to a page, the answer area on the page after it, ``end`` on a page
    boundary (each area whole pages: the coordinator pins and maps them for its GPU)."""
    req = _aligned(offset, HOST_ALIGN)
    ans = _aligned(req + request_bytes(rows, hidden, top_k, dtype), HOST_ALIGN)
    return req, ans, _aligned(ans + answer_bytes(rows, hidden, dtype), HOST_ALIGN)


def new_area(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 area (zero: no flag value yet)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class RequestViews:
    flag: torch.Tensor  # [1] int64
    x: torch.Tensor  # [R, H]
    ids: torch.Tensor  # [R, K] int32: local slot ids, -1 = none
    w: torch.Tensor  # [R, K] float32

    @classmethod
    def of(cls, buf: torch.Tensor, rows: int, hidden: int, top_k: int, dtype: torch.dtype) -> RequestViews:
        assert buf.dtype == torch.uint8 and buf.numel() >= request_bytes(rows, hidden, top_k, dtype)
        off_ids = _WORDS + _aligned(rows * hidden * dtype.itemsize)
        off_w = off_ids + _aligned(rows * top_k * 4)
        return cls(
            view(buf, 0, (1,), torch.int64),
            view(buf, _WORDS, (rows, hidden), dtype),
            view(buf, off_ids, (rows, top_k), torch.int32),
            view(buf, off_w, (rows, top_k), torch.float32),
        )


@dataclass(frozen=True)
class AnswerViews:
    flag: torch.Tensor  # [1] int64
    status: torch.Tensor  # [1] int64: ERR_* bits of the last answer
    out: torch.Tensor  # [R, H]

    @classmethod
    def of(cls, buf: torch.Tensor, rows: int, hidden: int, dtype: torch.dtype) -> AnswerViews:
        assert buf.dtype == torch.uint8 and buf.numel() >= answer_bytes(rows, hidden, dtype)
        return cls(
            view(buf, 0, (1,), torch.int64),
            view(buf, 64, (1,), torch.int64),  # NOTE: its own cache line
            view(buf, _WORDS, (rows, hidden), dtype),
        )


@dataclass(frozen=True)
class StepReport:
    """What the host learns of finished replays: the last one's step number and ERR_* bits,
    and the pairs routed to each slot since the last report that carried counts (``counts[i]``
    ``[S_i]`` for MoE layer position ``i``; padding and bad ids not counted; empty when this
    report carries none: a link folds them every few steps, gpu_server/link_graphs.py FOLD_EVERY)."""

    step: int
    errors: int
    counts: list[np.ndarray]

    @property
    def timed_out(self) -> bool:
        return bool(self.errors & ERR_TIMEOUT)

    @property
    def bad_slots(self) -> bool:
        return bool(self.errors & ERR_BAD_SLOT)

    @property
    def kernel_failed(self) -> bool:
        return bool(self.errors & ERR_KERNEL)
