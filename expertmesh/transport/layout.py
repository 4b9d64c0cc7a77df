"""Where things sit in a fast-path segment, and typed views into a byte ring.

A segment is a 4 KiB header (magic, the handshake token, ring offset and size) followed by the
host ring. Every payload offset is a multiple of ``descriptor.ALIGN``.
"""

from __future__ import annotations

import struct

import torch

from expertmesh.transport.descriptor import ALIGN

HEADER_BYTES = 4096
SEGMENT_MAGIC = b"EXPERTMESH-SHM1\0"
HEADER = struct.Struct("<16s16sQQ")  # magic, token, ring offset, ring bytes


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def view(ring: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``shape`` of ``dtype`` at byte ``offset`` of the uint8 tensor ``ring`` (no copy)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return ring[offset : offset + n].view(dtype).view(shape)
