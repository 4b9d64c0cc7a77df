"""The prefix index: which KV pages hold which token prefixes, for requests to share.

A block is one full page of a sequence: ``page_size`` tokens whose K/V were all computed. Its
key is (its parent block, the salt, its tokens), the parent being the block before it in the
same sequence (none for the first): a chain of keys, so a block stands for its whole prefix,
not only its own tokens. Keys are compared in full by the dict (no hash is trusted alone), and
a parent is named by a number never reused, so an evicted block's key cannot come back with
another page's contents.

The salt is whatever else changes the K/V of the same tokens: the LoRA adapter (its name and
the load that installed it), so an adapter's pages are never served to another adapter or to
the base model. The index belongs to one engine, so one model and one cache layout (MLA latent
or full K/V).

Pages themselves live in the :class:`~coordinator.model.kv_cache.PageAllocator`: it counts the
sequences holding each page and keeps unheld indexed pages until it needs room, then evicts
them least recently released first and calls :meth:`PrefixIndex.evicted`. A sequence holds the
whole chain of blocks it matched or added (or found indexed already when it filled the same
block itself: it takes that block's page in place of its own, Engine._index), and releases its
pages last first, so a block is always evicted before its parent: the chain of any indexed
block is indexed too.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from coordinator.model.kv_cache import PageAllocator

Salt = Hashable


@dataclass(eq=False)
class Block:
    uid: int
    page: int
    key: tuple[int, Salt, tuple[int, ...]]
    parent: Block | None
    children: int = 0


class PrefixIndex:
    """Blocks by key and by page. Not thread safe: the engine's user (the scheduler loop) is."""

    def __init__(self, page_size: int, pages: PageAllocator) -> None:
        self.page_size, self.pages = page_size, pages
        self._blocks: dict[tuple[int, Salt, tuple[int, ...]], Block] = {}
        self._by_page: dict[int, Block] = {}
        self._uids = itertools.count(1)  # 0 = no parent
        pages.on_evict = self.evicted

    @property
    def num_pages(self) -> int:
        """Pages in the index (held by sequences or kept)."""
        return len(self._by_page)

    def match(self, tokens: Sequence[int], salt: Salt, max_blocks: int) -> list[Block]:
        """The longest chain of indexed blocks that is a prefix of ``tokens``, at most
        ``max_blocks`` long. Changes nothing."""
        out: list[Block] = []
        p, parent = self.page_size, 0
        for i in range(min(max_blocks, len(tokens) // p)):
            blk = self._blocks.get((parent, salt, tuple(tokens[i * p : (i + 1) * p])))
            if blk is None:
                break
            out.append(blk)
            parent = blk.uid
        return out

    def find(self, parent: Block | None, salt: Salt, tokens: Sequence[int]) -> Block | None:
        """The indexed block of ``tokens`` after ``parent``, if any. Changes nothing."""
        return self._blocks.get((parent.uid if parent is not None else 0, salt, tuple(tokens)))

    def add(self, parent: Block | None, salt: Salt, tokens: Sequence[int], page: int) -> Block | None:
        """Indexes ``page`` (held by the caller, every row written) as the block of ``tokens``
        after ``parent``. Returns the new block, or None when that block is indexed already on
        another page (another sequence computed the same prefix, or a prompt of whole pages
        recomputed its last one): the caller may take that block's page in place of its own
        (Engine._index) and go on after it."""
        assert len(tokens) == self.page_size, f"{len(tokens)=}"
        key = (parent.uid if parent is not None else 0, salt, tuple(tokens))
        if key in self._blocks:
            return None
        assert page not in self._by_page, f"page {page} is indexed twice"
        blk = Block(next(self._uids), page, key, parent)
        self._blocks[key] = blk
        self._by_page[page] = blk
        if parent is not None:
            parent.children += 1
        self.pages.mark_indexed(page)
        return blk

    def evicted(self, page: int) -> None:
        """The allocator took back ``page`` (unheld): its block leaves the index."""
        blk = self._by_page.pop(page)
        # NOTE: a parent outlives its children (see the module docstring), so this is a leaf
        assert blk.children == 0, f"evicted block of page {page} has {blk.children} children"
        del self._blocks[blk.key]
        if blk.parent is not None:
            blk.parent.children -= 1
