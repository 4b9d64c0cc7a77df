"""Where things sit in a fast-path segment, and typed views into a byte ring.

A segment is a 4 KiB header (magic, the handshake token, ring offset and size) followed by the
host ring. Every payload offset is a multiple of ``descriptor.ALIGN``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from expertmesh.transport.descriptor import ALIGN

HEADER_BYTES = 4096
SEGMENT_MAGIC = b"EXPERTMESH-SHM1\0"
HEADER = struct.Struct("<16s16sQQ")  # magic, token, ring offset, ring bytes
# 32-bit counters in the header, each on its own cache line and with a single writer: requests
# written by the coordinator, responses written by the server (see spin.py for their use)
REQUESTS_WORD, RESPONSES_WORD = 64 // 4, 128 // 4


def header_words(mm) -> np.ndarray:
    """The header as uint32 words (the counters live there)."""
    return np.frombuffer(mm, dtype=np.uint32, count=HEADER_BYTES // 4)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def view(ring: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``shape`` of ``dtype`` at byte ``offset`` of the uint8 tensor ``ring`` (no copy)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return ring[offset : offset + n].view(dtype).view(shape)


class Views:
    """Typed views of a byte ring, memoised by (offset, shape, dtype).

    With one request in flight per stream (decode), the ring hands out the same offsets over
    and over, so a view costs a dictionary lookup instead of three tensor ops. The routing
    block also gets numpy views: for a few dozen bytes numpy's copies cost a fraction of
    torch's per-op overhead.
    """

    def __init__(self, ring: torch.Tensor, limit: int = 512) -> None:
        self.ring, self.limit = ring, limit
        self._np = ring.numpy() if ring.device.type == "cpu" else None
        self._torch: dict[tuple, torch.Tensor] = {}
        self._numpy: dict[tuple, np.ndarray] = {}

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (offset, shape, dtype)
        v = self._torch.get(key)
        if v is None:
            if len(self._torch) >= self.limit:
                self._torch.clear()
            # NOTE: made outside inference mode, so that it can be written in and out of it
            with torch.inference_mode(False):
                v = self._torch[key] = view(self.ring, offset, shape, dtype)
        return v

    def block(self, offset: int, tokens: int, top_k: int) -> np.ndarray:
        """The routing block ``[2, T, K]`` as int32 (row 1 holds float32 bits)."""
        key = (offset, tokens, top_k)
        v = self._numpy.get(key)
        if v is None:
            assert self._np is not None, "routing blocks live in host memory"
            if len(self._numpy) >= self.limit:
                self._numpy.clear()
            n = 2 * tokens * top_k * 4
            v = self._numpy[key] = self._np[offset : offset + n].view(np.int32).reshape(2, tokens, top_k)
        return v

    def adapters(self, offset: int, tokens: int, top_k: int) -> np.ndarray:
        """The ``[T]`` int32 adapter slots after the routing block at ``offset`` (FLAG_ADAPTERS)."""
        assert self._np is not None, "routing blocks live in host memory"
        start = offset + 2 * tokens * top_k * 4
        return self._np[start : start + tokens * 4].view(np.int32)

    def clear(self) -> None:
        self._torch.clear()
        self._numpy.clear()
        self._np = None
