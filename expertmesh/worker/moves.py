"""Per-layer slot moves of a placement change, and the order that applies them in place.

Pure: no tensors, no gRPC. The slot table (slots.py) plans each MoE layer with
:func:`plan_layer` (budget.py chooses which layers need a new allocation and what is staged),
and at commit rewrites a layer's slots in the order :func:`move_order` gives, through one
spare slot when the moves form a cycle.

Shapes: S live slots of a layer, S' slots of the new table.
"""

from __future__ import annotations

from dataclasses import dataclass

TEMP = -1  # the spare slot in a move order: ("save", s) copies slot s into it; a src of TEMP reads it


@dataclass(frozen=True)
class LayerPlan:
    """How one layer goes from its live slots to the prepared ones."""

    experts: tuple[int, ...]  # [S'] logical expert of each new slot
    moves: tuple[tuple[int, int], ...]  # (dst, src): new slot dst takes live slot src's weights
    reads: tuple[tuple[int, int], ...]  # (dst, expert): new slot dst takes an expert not resident here
    resize: bool  # S' != S: the live slot count changes
    # None: the slots are rewritten inside the live allocation (which holds at least S'); else
    # the slots of a new allocation (>= S') that every new slot is copied or read into
    rebuild: int | None = None

    @property
    def unchanged(self) -> bool:
        return not (self.resize or self.moves or self.reads) and self.rebuild is None


def plan_layer(live: tuple[int, ...], new: tuple[int, ...], rebuild: int | None = None) -> LayerPlan:
    """The moves from ``live [S]`` to ``new [S']``: in place (a slot that keeps its expert moves
    nothing; slots past S are spare slots of the allocation), or into a new allocation of
    ``rebuild`` slots (every slot is listed). Slots marked -1 in ``live`` (contents unknown after
    a failed commit) are never reused."""
    assert rebuild is None or rebuild >= len(new), f"{rebuild=} {len(new)=}"
    have: dict[int, int] = {}
    for s, e in enumerate(live):
        if e >= 0:
            have.setdefault(e, s)
    moves, reads = [], []
    for dst, e in enumerate(new):
        if rebuild is None and dst < len(live) and live[dst] == e and e >= 0:
            continue
        if e in have:
            moves.append((dst, have[e]))
        else:
            reads.append((dst, e))
    return LayerPlan(tuple(new), tuple(moves), tuple(reads), len(live) != len(new), rebuild)


def move_order(moves: tuple[tuple[int, int], ...]) -> list[tuple[str, int, int]]:
    """In-place order of ``moves`` (dst, src) within one layer: ``("copy", dst, src)`` steps and
    ``("save", s, TEMP)`` steps that park slot s in the spare slot, so that no slot is
    overwritten while a later copy still needs its old weights. A cycle costs one save; the
    spare slot is free again before the next one."""
    pending = dict(moves)  # dst -> src (TEMP once its src was saved)
    readers: dict[int, int] = {}
    for src in pending.values():
        readers[src] = readers.get(src, 0) + 1
    order: list[tuple[str, int, int]] = []
    temp_readers = 0
    while pending:
        ready = [d for d in pending if readers.get(d, 0) == 0]
        if not ready:  # only cycles are left: park one member, the cycle becomes a chain
            assert temp_readers == 0, f"spare slot still needed by {temp_readers} moves"
            d = next(iter(pending))
            order.append(("save", d, TEMP))
            for dst, src in pending.items():
                if src == d:
                    pending[dst] = TEMP
                    temp_readers += 1
            readers[d] = 0
            continue
        for d in ready:
            src = pending.pop(d)
            order.append(("copy", d, src))
            if src == TEMP:
                temp_readers -= 1
            else:
                readers[src] -= 1
    return order
