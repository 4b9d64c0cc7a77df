"""A first-in first-out allocator over a byte ring, private to the side that owns it.

The coordinator hands out every region of a channel (request payloads and the room for their
answers), so no allocator state is shared between processes: the server only reads and writes
where a descriptor points. Regions come back in any order but the space is reused in order
(the tail passes a region only when every older one came back), which is what a pipelined,
answered-in-order stream needs.

Back-pressure: :meth:`Ring.alloc` never waits. A payload that finds no room (larger than the
ring, or the ring still full of earlier requests) is sent over the gRPC stream instead, whose
HTTP/2 flow control then applies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Region:
    offset: int  # byte offset inside the ring
    nbytes: int
    end: int  # absolute position (bytes ever handed out) just past this region
    freed: bool = False


@dataclass
class Ring:
    capacity: int
    align: int = 256
    head: int = 0  # absolute positions: head - tail bytes are in use
    tail: int = 0
    _live: deque[Region] = field(default_factory=deque)

    def __post_init__(self) -> None:
        assert self.capacity > 0 and self.capacity % self.align == 0, f"{self.capacity=} {self.align=}"

    @property
    def used(self) -> int:
        return self.head - self.tail

    def alloc(self, nbytes: int) -> Region | None:
        """A contiguous region of at least ``nbytes``, or None if there is no room now."""
        n = -(-max(nbytes, 1) // self.align) * self.align
        if n > self.capacity:
            return None
        pos = self.head % self.capacity
        skip = self.capacity - pos if pos + n > self.capacity else 0  # never straddle the end
        if self.used + skip + n > self.capacity:
            return None
        start = self.head + skip
        self.head = start + n
        region = Region(start % self.capacity, n, self.head)
        self._live.append(region)
        return region

    def free(self, region: Region) -> None:
        region.freed = True
        while self._live and self._live[0].freed:
            self.tail = self._live.popleft().end
        if not self._live:  # empty: restart at 0 so a big region never wraps needlessly
            self.head = self.tail = 0
