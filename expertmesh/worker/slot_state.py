"""The live state of a slot table (slots.py): each layer's slots and the allocation they are a
view of, the placement generation they belong to, and the map from the generation a commit
replaced to the live slots.

Shapes: S live slots of a layer, A >= S slots of its allocation, H hidden, I expert
intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Rows = tuple[torch.Tensor, torch.Tensor]  # one slot: w13 row [2I, H] (or packed), w2 row [H, I]


@dataclass(frozen=True)
class LayerSlots:
    experts: tuple[int, ...]  # [S] logical expert of each local slot (-1: unknown, never computed)
    w13: torch.Tensor  # [S, 2I, H], or the backend's packed layout (slot still dim 0)
    w2: torch.Tensor  # [S, H, I], or packed
    # the allocation w13 and w2 are the first S slots of: [A, ...] each, A >= S (spare slots
    # past S take a growth in place); None: w13 and w2 are the whole allocation
    alloc: Rows | None = None

    @classmethod
    def of(cls, experts: tuple[int, ...], w13: torch.Tensor, w2: torch.Tensor) -> LayerSlots:
        """The first ``len(experts)`` slots of the allocation ``w13 [A, ...]``, ``w2 [A, ...]``."""
        n = len(experts)
        assert w13.shape[0] >= n and w2.shape[0] == w13.shape[0], f"{n=} {w13.shape=} {w2.shape=}"
        if w13.shape[0] == n:
            return cls(experts, w13, w2)
        return cls(experts, w13[:n], w2[:n], (w13, w2))

    @property
    def rows(self) -> Rows:
        """The whole allocation, spare slots included."""
        return self.alloc if self.alloc is not None else (self.w13, self.w2)

    @property
    def allocated(self) -> int:
        return self.rows[0].shape[0]


@dataclass(frozen=True)
class SlotSet:
    generation: int
    layers: dict[int, LayerSlots]
    # why this table must not compute ("" = it may): a commit that failed half-way
    broken: str = ""
    # a commit is rewriting these layers (requests wait for it under the worker's lock, or are
    # stale if they check now)
    committing: bool = False


@dataclass(frozen=True)
class PreviousSlots:
    """The generation the last commit replaced, as a map from its slots to the live ones:
    a coordinator that follows another's placement (coordinator/experts/pool.py) sends that
    generation for a moment after the commit, and its requests are computed on the live slots
    holding the same experts."""

    generation: int
    to_live: dict[int, torch.Tensor]  # layer -> [S_old] int64 live slot of each old slot, -2: gone

    @classmethod
    def between(
        cls, generation: int, before: dict[int, tuple[int, ...]], layers: dict[int, LayerSlots]
    ) -> PreviousSlots:
        to_live = {}
        for layer, old in before.items():
            where: dict[int, int] = {}
            for s, e in enumerate(layers[layer].experts):
                if e >= 0:
                    where.setdefault(e, s)
            to_live[layer] = torch.tensor([where.get(e, -2) for e in old], dtype=torch.long)
        return cls(generation, to_live)

    def translate(self, layer: int, slot_ids: torch.Tensor) -> torch.Tensor | None:
        """``slot_ids [T, K]`` (checked in range of the old layer) as live slots (-1 stays);
        None when a routed expert is no longer on this server."""
        m = self.to_live[layer].to(slot_ids.device)
        out = torch.where(slot_ids >= 0, m[slot_ids.clamp(min=0).long()], -1)
        if bool((out == -2).any()):
            return None
        return out.to(torch.int32)


def live_bytes(layers: dict[int, LayerSlots]) -> int:
    """Bytes of the allocations behind ``layers``: spare slots included, an allocation that
    several views share counted once."""
    seen: set[int] = set()
    n = 0
    for ls in layers.values():
        for t in (ls.w13, ls.w2):
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            n += t.untyped_storage().nbytes()
    return n
