"""Paged KV cache and its page allocator.

The cache is one pool of fixed-size pages per layer. A sequence owns a list of pages (its page
table); token position p of the sequence lives at page ``table[p // page_size]``, row
``p % page_size``. Pages are handed out and returned by :class:`PageAllocator`, which counts
references: with prefix caching (coordinator/model/prefix_cache.py) several sequences share the
pages of a common prompt prefix, and full pages stay cached after their sequences end, until
the allocator needs the room. The scheduler decides who gets pages.

MLA models (DeepSeek-V2/V3, Kimi-K2) cache the compressed latent instead of per-head K/V: one
row of ``Rkv + Dr`` values per token (the normalised ``kv_lora_rank`` latent, then the rotated
``qk_rope_head_dim`` key part shared by all heads). Attention reads it as one shared KV head
(coordinator/model/models/mla.py): ``k`` is the whole row, ``v`` a view of its first ``Rkv`` values,
so the pool is stored once.

Shapes: L layers, N pages, P page size, Hk cached heads, Dk key dim, Dv value dim, Rkv/Dr MLA
latent rank / rotary dim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from expertmesh.config import ModelConfig


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Page ids with reference counts. Not thread safe: the scheduler's loop is its only user.

    A page is free, held (reference count > 0: in the page table of one or more sequences) or
    kept: held by no one but indexed by the prefix cache for its contents. Kept pages count as
    free: once the free list is empty, :meth:`alloc` takes them least recently released first and
    tells ``on_evict`` (the prefix index drops them). Held pages are never taken.
    """

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, f"{num_pages=}"
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._indexed = [False] * num_pages  # contents known to the prefix index
        self._kept: OrderedDict[int, None] = OrderedDict()  # indexed, unheld; oldest first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages :meth:`alloc` can hand out: free or kept."""
        return len(self._free) + len(self._kept)

    @property
    def num_kept(self) -> int:
        """Indexed pages no sequence holds (evictable)."""
        return len(self._kept)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def indexed(self, page: int) -> bool:
        return self._indexed[page]

    def alloc(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._kept.popitem(last=False)
                self._indexed[page] = False
                if self.on_evict is not None:
                    self.on_evict(page)
            self._refs[page] = 1
            out.append(page)
        return out

    def share(self, pages: list[int]) -> None:
        """One more reference to each of ``pages`` (held or kept)."""
        for page in pages:
            if self._refs[page] == 0:
                assert self._indexed[page], f"page {page} is free"
                del self._kept[page]
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each of ``pages``. Unheld indexed pages are kept, the last
        page first: a sequence's later pages extend its earlier ones in the prefix index and
        must be evicted before them."""
        for page in reversed(pages):
            assert self._refs[page] > 0, f"page {page} was freed twice"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._indexed[page]:
                    self._kept[page] = None
                else:
                    self._free.append(page)

    def mark_indexed(self, page: int) -> None:
        """``page`` (held, fully written) entered the prefix index."""
        assert self._refs[page] > 0, f"page {page} is not held"
        self._indexed[page] = True


@dataclass(frozen=True)
class KVCacheSpec:
    num_pages: int
    page_size: int

    @staticmethod
    def values_per_token(cfg: ModelConfig) -> int:
        """Cached values per token per layer."""
        if cfg.attention == "mla":
            return cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return cfg.kv_heads_cached * (cfg.q_head_dim + cfg.v_dim)

    @classmethod
    def bytes_per_page(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        per_tok = cls.values_per_token(cfg) * cfg.num_layers
        return per_tok * page_size * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(
        cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        n = budget_bytes // cls.bytes_per_page(cfg, page_size, dtype)
        if n < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds not even one page of {page_size} tokens"
            )
        return cls(int(n), page_size)


class KVCache:
    def __init__(self, cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        n, p, hk = spec.num_pages, spec.page_size, cfg.kv_heads_cached
        # NOTE: one page past the allocator's: padding rows of a CUDA-graph step write there
        rows = (n + 1) * p
        self.mla = cfg.attention == "mla"
        if self.mla:
            # [L, rows, 1, Rkv + Dr]: latent then rotated key part; v is the latent (a view)
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            self.k = torch.zeros(cfg.num_layers, rows, 1, width, dtype=dtype, device=device)
            self.v = self.k[..., : cfg.kv_lora_rank]
        elif device.type == "cpu":
            # NOTE: stored head-major ([L, Hk, rows, D], seen as [L, rows, Hk, D]): the CPU
            # attention gathers a sequence's pages per KV head, and from this layout that gather
            # is the only copy (row-major storage needs a second, transposing one per layer)
            self.k = torch.zeros(cfg.num_layers, hk, rows, cfg.q_head_dim, dtype=dtype).transpose(1, 2)
            self.v = torch.zeros(cfg.num_layers, hk, rows, cfg.v_dim, dtype=dtype).transpose(1, 2)
        else:
            self.k = torch.zeros(cfg.num_layers, rows, hk, cfg.q_head_dim, dtype=dtype, device=device)
            self.v = torch.zeros(cfg.num_layers, rows, hk, cfg.v_dim, dtype=dtype, device=device)
        self.scratch_row = n * p  # never handed out, never read

    @property
    def page_size(self) -> int:
        return self.spec.page_size
