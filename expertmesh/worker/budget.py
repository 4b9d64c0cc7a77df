"""Where a placement change's slots go in memory: which layers are rewritten inside their live
allocation, which get a new allocation (built during prepare, so the commit only swaps it in,
or in the commit when the budget is spent), and which new experts are read ahead.

Pure: no tensors, no gRPC. Sizes are in slots (one slot: one expert's w13 + w2 rows).

Each layer of a server keeps an allocation of A >= S slots and computes on its first S (a view):
a resize within A rewrites only the slots that change and moves the live count. Two budgets:

- ``spare`` (default half of ``budget``): the spare slots (A - S, summed over layers) a server
  keeps between changes. A layer given a new allocation gets ``spare / layers`` slots of
  headroom (none when only its exact size fits the room); a shrinking layer keeps its
  allocation, and when the spare slots would pass ``spare`` the layers that free the most spare
  slots per slot copied are trimmed to their size plus headroom.
- ``budget`` B (one layer of the server's slots, or ``--placement-staging-mb``), less the spare
  slots held: the room a change may use beyond the live allocations while it runs. In order:
  layers that outgrow their allocation are built during prepare where they fit (the commit
  swaps them in), else rebuilt by the commit; experts are read ahead (what does not fit is
  read by the commit); then trims are built where the room left fits them. A trim that does
  not fit waits for a later change while the spare slots stay within ``WAITING_SPARE`` x B
  (past that the commit rebuilds it): it only gives memory back, and copying a whole layer
  inside the commit stalls decoding. New slots that land in spare slots cost no room: nothing
  computes them, so the prepare writes them in place.

So between changes a server holds its experts plus at most ``spare`` slots (``WAITING_SPARE``
x B while trims wait); during a change at most B beyond the experts it held before, except for
a layer the commit rebuilds (its new allocation, at most the server's slot capacity, is the
transient). On a GPU the commit's copies
are device copies; on the CPU the room is what keeps the commit's work near the slots that
change (benchmarks/sim_slot_layout.py counts both at any model size).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from expertmesh.worker.moves import LayerPlan, plan_layer

# the spare slots a server may hold while trims wait for room, as a share of the budget (the
# spare target is half of it)
WAITING_SPARE = 0.75


@dataclass(frozen=True)
class Layout:
    plans: dict[int, LayerPlan]
    built: frozenset[int]  # layers whose new allocation the prepare builds (the commit swaps it in)
    loads: frozenset[int]  # ... of them, layers that held nothing (built outside the budget)
    staged: frozenset[tuple[int, int]]  # (layer, dst) experts read ahead during prepare
    # (layer, dst) slots past a layer's live ones, inside its allocation: nothing computes them,
    # so the prepare writes them in place (read or copied from a live slot) at no memory cost
    direct: frozenset[tuple[int, int]]


def headroom(spare: int, layers: int, capacity: int, size: int, exact: bool = False) -> int:
    """Slots of a new allocation for ``size`` live slots: ``spare`` shared evenly over the
    ``layers``, never past ``capacity``; exactly ``size`` for ``exact`` tables and empty layers."""
    if exact or size == 0:
        return size
    return min(capacity, size + spare // max(1, layers))


def plan_change(
    live: dict[int, tuple[int, ...]],
    allocated: dict[int, int],
    table: dict[int, tuple[int, ...]],
    capacity: int,
    budget: int,
    spare: int,
    exact: bool = False,
) -> Layout:
    """Lays out the change from ``live`` (layer -> [S] experts in an allocation of
    ``allocated[layer]`` slots) to ``table`` (layer -> [S'], layers left out hold nothing).
    ``exact``: every allocation holds exactly its live slots (a backend that places a layer's
    memory by its slot count), so every resize is a new allocation."""
    order = sorted(live)
    size = {layer: len(table.get(layer, ())) for layer in order}
    plans: dict[int, LayerPlan] = {}
    grow: list[int] = []
    loads: set[int] = set()
    for layer in order:
        old, new, a = live[layer], tuple(table.get(layer, ())), allocated[layer]
        alloc = headroom(spare, len(order), capacity, len(new), exact)
        if a == 0 and new:  # holds nothing: a load, doubles nothing
            plans[layer] = plan_layer(old, new, alloc)
            loads.add(layer)
        elif not new and old:  # holds nothing from now on: its allocation goes
            plans[layer] = plan_layer(old, new, 0)
        elif len(new) > a or (exact and len(new) != len(old)):
            plans[layer] = plan_layer(old, new, alloc)
            grow.append(layer)
        else:
            plans[layer] = plan_layer(old, new)
    spare_now = sum(allocated[layer] - len(live[layer]) for layer in order)
    room = max(0, budget - spare_now)
    built: set[int] = set(loads)
    staged: set[tuple[int, int]] = set()

    def fits() -> bool:
        return _peak(plans, allocated, built, loads, staged) <= room

    for layer in grow:  # first: a growth the prepare does not build is a rebuild in the commit
        built.add(layer)
        if fits():
            continue
        with_headroom = plans[layer]
        plans[layer] = plan_layer(live[layer], tuple(table.get(layer, ())), size[layer])
        if not fits():  # NOTE: rebuilt in the commit, with headroom so it grows in place next time
            plans[layer] = with_headroom
            built.discard(layer)
    for layer in order:  # then experts read ahead, in layer order (the commit reads the rest)
        if layer in built:
            continue
        full = False
        for dst, _ in plans[layer].reads:
            if plans[layer].rebuild is None and dst >= len(live[layer]):
                continue  # direct
            staged.add((layer, dst))
            if not fits():
                staged.discard((layer, dst))
                full = True
                break
        if full:
            break
    # last: trims, while the spare slots would pass ``spare``, the layers that free the most
    # spare slots per slot copied first; built during prepare where the room left fits them.
    # NOTE: a trim only gives memory back, so one that does not fit waits for a later change
    # (the commit would copy its whole layer inside the between-steps window) while the spare
    # slots stay within ``WAITING_SPARE`` of the budget: the room of the next change is what is
    # left, and it stages that change's reads
    left = sum(_alloc_after(plans[layer], allocated[layer]) - size[layer] for layer in order)
    if all(p.unchanged for p in plans.values()):
        left = 0  # NOTE: a push equal to the live placement touches no weight, not even to trim
    trims = sorted(
        (-(allocated[layer] - headroom(spare, len(order), capacity, size[layer], exact)) / size[layer], layer)
        for layer in order
        if plans[layer].rebuild is None and size[layer] > 0
    )
    for _, layer in trims:
        alloc = headroom(spare, len(order), capacity, size[layer], exact)
        if left <= spare or allocated[layer] <= alloc:
            break
        in_place = plans[layer]
        plans[layer] = plan_layer(live[layer], tuple(table.get(layer, ())), alloc)
        own = {k for k in staged if k[0] == layer}  # a built layer reads its new experts itself
        staged -= own
        built.add(layer)
        if not fits():
            built.discard(layer)
            staged |= own
            if left <= budget * WAITING_SPARE:
                plans[layer] = in_place
                continue
        left -= allocated[layer] - alloc
    direct = frozenset(
        (layer, dst)
        for layer in order
        if plans[layer].rebuild is None
        for dst, _ in (*plans[layer].moves, *plans[layer].reads)
        if dst >= len(live[layer])
    )
    return Layout(plans, frozenset(built), frozenset(loads), frozenset(staged), direct)


def _alloc_after(plan: LayerPlan, allocated: int) -> int:
    return allocated if plan.rebuild is None else plan.rebuild


def _peak(
    plans: dict[int, LayerPlan],
    allocated: dict[int, int],
    built: set[int],
    loads: set[int],
    staged: set[tuple[int, int]],
) -> int:
    """The most slots held beyond the live allocations from the end of prepare through the
    commit, which rewrites the layers in order: new allocations built during prepare (each
    frees the live one when swapped in), staged reads (freed once their layer is rewritten), a
    layer rebuilt in the commit (its new allocation), the spare slot of in-place moves."""
    extra = sum(plans[layer].rebuild or 0 for layer in built - loads) + len(staged)
    peak = extra
    per = Counter(layer for layer, _ in staged)
    for layer in sorted(plans):
        p = plans[layer]
        if layer in loads or p.unchanged:
            continue
        if layer in built:
            extra -= allocated[layer]
        elif p.rebuild is not None:
            peak = max(peak, extra + p.rebuild)
            extra += p.rebuild - allocated[layer] - per[layer]
        else:
            peak = max(peak, extra + (1 if p.moves else 0))
            extra -= per[layer]
    return peak
