"""Per-layer slot moves of a placement change, and the order that applies them in place.

Pure: no tensors, no gRPC. The slot table (slots.py) plans each MoE layer with
:func:`plan_layer`, stages what it can read ahead within a byte budget (:func:`stage_reads`),
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
    resize: bool  # S' != S: a new allocation of S' slots; otherwise the live one is rewritten

    @property
    def unchanged(self) -> bool:
        return not (self.resize or self.moves or self.reads)


def plan_layer(live: tuple[int, ...], new: tuple[int, ...]) -> LayerPlan:
    """The moves from ``live [S]`` to ``new [S']``; a slot that keeps its expert moves nothing.
    Slots marked -1 in ``live`` (contents unknown after a failed commit) are never reused."""
    have: dict[int, int] = {}
    for s, e in enumerate(live):
        if e >= 0:
            have.setdefault(e, s)
    resize = len(live) != len(new)
    moves, reads = [], []
    for dst, e in enumerate(new):
        if not resize and live[dst] == e and e >= 0:
            continue
        if e in have:
            moves.append((dst, have[e]))
        else:
            reads.append((dst, e))
    return LayerPlan(tuple(new), tuple(moves), tuple(reads), resize)


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


def stage_reads(
    plans: dict[int, LayerPlan], live_slots: dict[int, int], slot_bytes: int, budget: int
) -> set[tuple[int, int]]:
    """Which (layer, dst) reads a prepare reads ahead, in layer order, so that at no point of the
    commit that follows the staged slots still held plus the layer being rewritten's transient
    (a rebuilt layer: its new allocation; one rewritten in place: its spare slot) exceed
    ``budget`` bytes. Layers rebuilt from nothing (``live_slots`` 0) are left out: the prepare
    builds them whole (they double nothing). Returns the staged (layer, dst) pairs."""
    order = sorted(plans)
    transient = {}
    for layer in order:
        p = plans[layer]
        if p.unchanged:
            transient[layer] = 0
        elif p.resize:
            transient[layer] = len(p.experts) * slot_bytes
        else:
            transient[layer] = slot_bytes if p.moves else 0
    staged_in: dict[int, int] = {layer: 0 for layer in order}
    chosen: set[tuple[int, int]] = set()
    for j, layer in enumerate(order):
        p = plans[layer]
        if live_slots.get(layer, 0) == 0:
            continue
        for dst, _ in p.reads:
            # the commit reaches layer i (i <= j) holding every staged slot of layers >= i
            tail, worst = slot_bytes, 0
            for i in range(j, -1, -1):
                tail += staged_in[order[i]]
                worst = max(worst, tail + transient[order[i]])
            if worst > budget:
                return chosen
            staged_in[layer] += slot_bytes
            chosen.add((layer, dst))
    return chosen
