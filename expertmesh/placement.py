"""Expert placement: which physical slots hold which logical experts, on which server.

A *logical* expert is the model's expert ``e`` of layer ``l``; a *physical slot* is a place on
one server holding one logical expert's weights. A logical expert may have several slots
(replicas) on one or several servers. A :class:`Placement` is pure data, versioned by a
generation number; everything around it is a pure function.

Shapes: E logical experts, P physical slots of a layer, R max replicas, T tokens, K top-k.

JSON placement file (``--placement FILE``)::

    {"servers": ["gpu0", "cpu0"],            # names as given to the coordinator
     "layers": {"*": {"gpu0": [0, 1, 2], "cpu0": [2, 3, 4, 5, 6, 7]},   # default for every MoE layer
                "3": {"gpu0": [0, 1], "cpu0": [2, 3, 4, 5, 6, 7, 0]}}}  # per-layer override

Each server lists the logical experts of its local slots in slot order; an expert listed by
several servers (or twice by one) is replicated. Every expert must appear at least once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from expertmesh.replica import choose_load_aware

# NOTE: generations travel as uint64 but are counted in Python ints, SQL, JSON...: both sides
# refuse anything above this, so "newest + 1" never overflows and a bogus push cannot wedge a cluster.
MAX_GENERATION = 2**53 - 1


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class LayerPlacement:
    phy2log: tuple[int, ...]  # [P] logical expert of each physical slot
    owner: tuple[int, ...]  # [P] server index of each physical slot
    local_slot: tuple[int, ...]  # [P] slot index on its owner

    def __post_init__(self) -> None:
        if not len(self.phy2log) == len(self.owner) == len(self.local_slot):
            raise PlacementError(
                f"ragged layer placement: {len(self.phy2log)} slots, {len(self.owner)} owners, "
                f"{len(self.local_slot)} local slots"
            )

    def logcnt(self, num_experts: int) -> list[int]:  # [E] replicas per logical expert
        cnt = [0] * num_experts
        for e in self.phy2log:
            cnt[e] += 1
        return cnt

    def log2phy(self, num_experts: int) -> list[list[int]]:  # [E][R] physical slots, -1 padded
        rows: list[list[int]] = [[] for _ in range(num_experts)]
        for p, e in enumerate(self.phy2log):
            rows[e].append(p)
        width = max(1, max(len(r) for r in rows))
        return [r + [-1] * (width - len(r)) for r in rows]

    def server_experts(self, server: int) -> list[int]:
        """Logical expert held in each local slot of ``server``, in slot order."""
        slots = sorted((s, e) for e, o, s in zip(self.phy2log, self.owner, self.local_slot) if o == server)
        return [e for _, e in slots]


@dataclass(frozen=True)
class Placement:
    generation: int
    servers: tuple[str, ...]
    num_experts: int
    layers: dict[int, LayerPlacement]

    def validate(self) -> None:
        for layer, lp in self.layers.items():
            missing = [e for e, c in enumerate(lp.logcnt(self.num_experts)) if c == 0]
            if missing:
                raise PlacementError(f"layer {layer}: experts {missing} have no slot on any server")
            if any(not 0 <= o < len(self.servers) for o in lp.owner):
                raise PlacementError(f"layer {layer}: slot owner outside servers {self.servers}")
            for s in range(len(self.servers)):
                local = sorted(ls for o, ls in zip(lp.owner, lp.local_slot) if o == s)
                if local != list(range(len(local))):
                    raise PlacementError(f"layer {layer}: local slots of {self.servers[s]} are not 0..n-1")

    def server_slots(self, server: int) -> dict[int, list[int]]:
        """The slot table pushed to one server: layer -> logical expert per local slot."""
        return {layer: lp.server_experts(server) for layer, lp in self.layers.items()}

    def with_generation(self, generation: int) -> Placement:
        if not 0 < generation <= MAX_GENERATION:
            raise PlacementError(f"placement generation {generation} outside [1, {MAX_GENERATION}]")
        return Placement(generation, self.servers, self.num_experts, self.layers)

    @cached_property
    def tables(self) -> dict[int, LayerTables]:
        return {layer: LayerTables.build(lp, self.num_experts) for layer, lp in self.layers.items()}

    def to_json(self) -> dict:
        return {
            "servers": list(self.servers),
            "layers": {
                str(layer): {name: lp.server_experts(i) for i, name in enumerate(self.servers)}
                for layer, lp in self.layers.items()
            },
        }


@dataclass(frozen=True)
class LayerTables:
    """A layer's placement as lookup tensors for the dispatch hot path."""

    log2phy: torch.Tensor  # [E, R] int64, -1 padded
    logcnt: torch.Tensor  # [E] int64
    owner: torch.Tensor  # [P] int64
    local_slot: torch.Tensor  # [P] int64

    @classmethod
    def build(cls, lp: LayerPlacement, num_experts: int) -> LayerTables:
        return cls(
            torch.tensor(lp.log2phy(num_experts), dtype=torch.long),
            torch.tensor(lp.logcnt(num_experts), dtype=torch.long),
            torch.tensor(lp.owner, dtype=torch.long),
            torch.tensor(lp.local_slot, dtype=torch.long),
        )


def from_server_lists(
    generation: int, servers: tuple[str, ...], num_experts: int, per_layer: dict[int, dict[str, list[int]]]
) -> Placement:
    """Builds a placement from, per layer, each server's list of logical experts in slot order."""
    layers: dict[int, LayerPlacement] = {}
    for layer, lists in per_layer.items():
        unknown = set(lists) - set(servers)
        if unknown:
            raise PlacementError(f"layer {layer}: unknown servers {sorted(unknown)}; known: {list(servers)}")
        phy2log: list[int] = []
        owner: list[int] = []
        local: list[int] = []
        for s, name in enumerate(servers):
            for slot, e in enumerate(lists.get(name, [])):
                if not 0 <= int(e) < num_experts:
                    raise PlacementError(f"layer {layer}: expert {e} on {name} outside [0, {num_experts})")
                phy2log.append(int(e))
                owner.append(s)
                local.append(slot)
        layers[layer] = LayerPlacement(tuple(phy2log), tuple(owner), tuple(local))
    p = Placement(generation, servers, num_experts, layers)
    p.validate()
    return p


def static_split(
    moe_layers: list[int], num_experts: int, gpu: list[str], cpu: list[str], num_gpu_experts: int
) -> Placement:
    """Logical ids < N on the GPU server(s), the rest on the CPU server(s), like
    ``--kt-num-gpu-experts``; several servers of one kind split their share in contiguous runs."""
    if not 0 <= num_gpu_experts <= num_experts:
        raise PlacementError(f"--num-gpu-experts {num_gpu_experts} outside [0, {num_experts}]")
    if num_gpu_experts and not gpu:
        raise PlacementError(f"--num-gpu-experts {num_gpu_experts} needs a GPU expert server")
    if num_gpu_experts < num_experts and not cpu:
        raise PlacementError(
            f"experts {num_gpu_experts}..{num_experts - 1} need a CPU expert server "
            f"(or --num-gpu-experts {num_experts})"
        )
    lists: dict[str, list[int]] = {}
    for names, ids in ((gpu, list(range(num_gpu_experts))), (cpu, list(range(num_gpu_experts, num_experts)))):
        for i, name in enumerate(names):
            lo, hi = i * len(ids) // len(names), (i + 1) * len(ids) // len(names)
            lists[name] = ids[lo:hi]
    servers = tuple(gpu + cpu)
    return from_server_lists(1, servers, num_experts, {layer: lists for layer in moe_layers})


def load_file(
    path: str | Path, moe_layers: list[int], num_experts: int, servers: tuple[str, ...]
) -> Placement:
    return parse_json(Path(path).read_text(), moe_layers, num_experts, servers, str(path))


def file_server_names(path: str | Path) -> set[str]:
    """The server names a placement file uses (its ``servers`` and every layer's keys); empty
    when it cannot be read (:func:`load_file` reports why)."""
    try:
        raw = json.loads(Path(path).read_text())
        names = {str(n) for n in raw.get("servers", ())}
        for spec in raw.get("layers", {}).values():
            names.update(str(k) for k in spec)
    except (OSError, ValueError, AttributeError, TypeError):
        return set()
    return names


def parse_json(
    text: str, moe_layers: list[int], num_experts: int, servers: tuple[str, ...], path: str = "placement"
) -> Placement:
    """A placement file's text (see the module docstring) -> a validated placement."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlacementError(f"{path}: not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise PlacementError(f"{path}: expected a JSON object with 'servers' and 'layers'")
    layer_specs = raw.get("layers")
    if not isinstance(layer_specs, dict):
        raise PlacementError(f"{path}: 'layers' must be an object of layer -> {{server: [experts]}}")
    default = layer_specs.get("*")
    per_layer: dict[int, dict[str, list[int]]] = {}
    for layer in moe_layers:
        spec = layer_specs.get(str(layer), default)
        if spec is None:
            raise PlacementError(f"{path}: no entry for MoE layer {layer} and no '*' default")
        per_layer[layer] = {str(k): [int(e) for e in v] for k, v in spec.items()}
    extra = {k for k in layer_specs if k != "*"} - {str(layer) for layer in moe_layers}
    if extra:
        raise PlacementError(f"{path}: layers {sorted(extra)} are not MoE layers of this model")
    file_servers = tuple(raw.get("servers", servers))
    if set(file_servers) != set(servers):
        raise PlacementError(
            f"{path}: servers {list(file_servers)} differ from the configured {list(servers)}"
        )
    return from_server_lists(1, servers, num_experts, per_layer)


# ---------------------------------------------------------------- dispatch-time functions


def choose_replicas(
    topk_ids: torch.Tensor,  # [T, K] logical
    tables: LayerTables,
    policy: str,
    offset: int = 0,
) -> torch.Tensor:  # [T, K] physical slot ids
    """Maps each (token, k) to one physical slot of its logical expert.

    ``static``: always the first replica. ``round_robin``: replicas in turn, (token, k) pairs
    numbered from ``offset`` (callers advance it per step so load spreads over steps too).
    ``load_aware``: each token to the least loaded of its expert's replicas' servers in this
    step (expertmesh/replica.py).
    """
    if policy == "static":
        return tables.log2phy[topk_ids, 0]
    if policy == "round_robin":
        t, k = topk_ids.shape
        counter = offset + torch.arange(t * k, dtype=torch.long).view(t, k)
        r = counter % tables.logcnt[topk_ids]
        return tables.log2phy[topk_ids, r]
    if policy == "load_aware":
        num_servers = int(tables.owner.max()) + 1
        return choose_load_aware(topk_ids, tables.log2phy, tables.logcnt, tables.owner, num_servers)
    raise PlacementError(f"unknown replica policy {policy!r}; expected static, round_robin or load_aware")


@dataclass(frozen=True)
class ServerBatch:
    """The compacted share of one step's tokens for one server."""

    server: int
    rows: torch.Tensor  # [T_s] rows of the step
    slot_ids: torch.Tensor  # [T_s, K] int32 local slots, -1 where the slot is elsewhere
    weights: torch.Tensor  # [T_s, K] float32


def split_by_server(
    phys: torch.Tensor,  # [T, K] physical slots
    weights: torch.Tensor,  # [T, K]
    tables: LayerTables,
    num_servers: int,
    pairs: torch.Tensor | None = None,  # [T, K] bool: only these (token, k) pairs (a re-send)
) -> list[ServerBatch]:
    """Per server: the rows with at least one slot on it, other slots masked as -1."""
    owner = tables.owner[phys]  # [T, K]
    local = tables.local_slot[phys]  # [T, K]
    out = []
    for s in range(num_servers):
        mine = owner == s  # [T, K]
        if pairs is not None:
            mine &= pairs
        rows = mine.any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        slot_ids = torch.where(mine, local, -1)[rows].to(torch.int32)
        out.append(ServerBatch(s, rows, slot_ids, weights[rows].float()))
    return out


# ---------------------------------------------------------------- what each server holds


@dataclass(frozen=True)
class ServerTables:
    """One placement generation as the cluster pushes it and the dispatcher routes with it.

    ``slots[s]`` is server ``s``'s slot table (layer -> logical expert per local slot). With a
    prefill threshold, ``full_server`` (the first GPU server) also holds every expert it is not
    already given, appended after its placement slots, and ``full_slots[layer]`` ``[E]`` is the
    local slot of each logical expert there (its first slot when it has several)."""

    placement: Placement
    slots: tuple[dict[int, list[int]], ...]
    full_server: int | None = None
    full_slots: dict[int, torch.Tensor] | None = None  # layer -> [E] int64

    @property
    def generation(self) -> int:
        return self.placement.generation

    def slots_needed(self, server: int) -> int:
        """The most slots of any layer on ``server`` (compare with its capacity)."""
        return max((len(x) for x in self.slots[server].values()), default=0)


def check_capacity(placement: Placement, capacity: Sequence[int]) -> None:
    """Raises :class:`PlacementError` when the placement gives a server more slots in some layer
    than it accepts (``capacity[i]``, the server's slots per layer)."""
    for i, name in enumerate(placement.servers):
        need = max((len(x) for x in placement.server_slots(i).values()), default=0)
        if need > capacity[i]:
            raise PlacementError(
                f"{name} holds at most {capacity[i]} slots per layer, the placement gives it {need}"
            )


def server_tables(placement: Placement, full_server: int | None = None) -> ServerTables:
    tables = [placement.server_slots(i) for i in range(len(placement.servers))]
    if full_server is None:
        return ServerTables(placement, tuple(tables))
    full_slots: dict[int, torch.Tensor] = {}
    e_all = placement.num_experts
    for layer, experts in tables[full_server].items():
        extra = [e for e in range(e_all) if e not in experts]
        tables[full_server][layer] = experts + extra
        where = {e: s for s, e in reversed(list(enumerate(tables[full_server][layer])))}
        full_slots[layer] = torch.tensor([where[e] for e in range(e_all)], dtype=torch.long)
    return ServerTables(placement, tuple(tables), full_server, full_slots)


def all_on_server(
    tables: ServerTables, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> ServerBatch:
    """A step above the prefill threshold: every (token, k) to ``full_server``'s slots."""
    assert tables.full_server is not None and tables.full_slots is not None, "no full server"
    rows = torch.arange(topk_ids.shape[0])  # [T]
    slots = tables.full_slots[layer][topk_ids].to(torch.int32)  # [T, K]
    return ServerBatch(tables.full_server, rows, slots, topk_weights.float())


# ---------------------------------------------------------------- routing around down servers


def live_tables(t: LayerTables, down: frozenset[int]) -> LayerTables:
    """``t`` without the slots of the servers in ``down``: each expert's live replicas first in
    ``log2phy [E, R]`` (-1 padded), ``logcnt [E]`` counts only them (0 = no live replica)."""
    if not down:
        return t
    rows = []
    for phys in t.log2phy.tolist():  # [E][R]
        live = [p for p in phys if p >= 0 and int(t.owner[p]) not in down]
        rows.append(live)
    width = max(1, max(len(r) for r in rows))
    log2phy = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)
    logcnt = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return LayerTables(log2phy, logcnt, t.owner, t.local_slot)


def uncovered(tables: dict[int, LayerTables], down: frozenset[int]) -> dict[int, list[int]]:
    """Per layer, the experts whose every replica lives on a server in ``down`` (empty: none)."""
    out = {}
    for layer, t in tables.items():
        lost = [e for e, c in enumerate(live_tables(t, down).logcnt.tolist()) if c == 0]
        if lost:
            out[layer] = lost
    return out
