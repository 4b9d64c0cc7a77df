"""The slot table of an expert server: which logical expert each local slot holds, per layer,
and the stacked weights the backend computes with.

Placement changes are two-phase: :meth:`SlotTable.prepare` builds the new table beside the live
one (reusing weights already resident, reading only new experts from the checkpoint),
:meth:`commit` swaps it in, :meth:`abort` drops it. Forward reads ``live`` only. Errors are
typed: :class:`SlotError` (an InvalidRequest) for a table that cannot be built,
``StaleGeneration`` for a phase naming the wrong generation.

Shapes: S local slots of a layer, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import InvalidRequest, StaleGeneration
from expertmesh.placement import MAX_GENERATION


class SlotError(InvalidRequest, ValueError):
    """A slot table that cannot be built: unknown layers or experts, more slots than capacity."""


@dataclass(frozen=True)
class LayerSlots:
    experts: tuple[int, ...]  # [S] logical expert of each local slot
    w13: torch.Tensor  # [S, 2I, H], or the backend's packed layout (slot still dim 0)
    w2: torch.Tensor  # [S, H, I], or packed


@dataclass(frozen=True)
class SlotSet:
    generation: int
    layers: dict[int, LayerSlots]


def parse_expert_spec(spec: str, num_experts: int) -> list[int]:
    """``all`` | ``none`` | ``0-15,32,40-47`` -> sorted logical expert ids."""
    spec = spec.strip().lower()
    if spec == "all":
        return list(range(num_experts))
    if spec in ("none", ""):
        return []
    ids: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if not 0 <= a <= b < num_experts:
            raise SlotError(f"expert range {part!r} outside [0, {num_experts})")
        ids.update(range(a, b + 1))
    return sorted(ids)


class SlotTable:
    def __init__(
        self,
        reader: CheckpointReader,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        pack: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
        read_expert: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        stack: Callable[[list[torch.Tensor], list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
        | None = None,
    ) -> None:
        self.reader, self.dtype, self.device, self.capacity = reader, dtype, device, capacity
        # ExpertBackend.pack_weights: applied once per expert as it is read, so reuse and stacking
        # work on packed tensors
        self.pack = pack or (lambda w13, w2: (w13, w2))
        # (layer, expert) -> the backend's own per-slot rows, read as stored (FP8
        # experts); replaces both the float read and pack. None: float weights, then pack
        self.read_expert = read_expert
        # a layer's slots -> its stacked w13, w2; a backend that places memory (NUMA
        # nodes, cpu_expert_server/numa_backend.py) allocates them itself. None: torch.stack
        self.stack = stack or (lambda w13, w2: (torch.stack(w13), torch.stack(w2)))
        self.moe_layers = reader.config.moe_layer_ids
        self.live = SlotSet(0, {layer: self._empty() for layer in self.moe_layers})
        self._staged: SlotSet | None = None
        self._lock = threading.Lock()  # guards _staged against concurrent prepares

    def _empty(self) -> LayerSlots:
        cfg = self.reader.config
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        dt, dev = self.dtype, self.device
        return LayerSlots(
            (),
            *self.pack(
                torch.empty(0, 2 * i, h, dtype=dt, device=dev), torch.empty(0, h, i, dtype=dt, device=dev)
            ),
        )

    def _build(self, layer: int, experts: list[int], reuse: LayerSlots | None) -> tuple[LayerSlots, int]:
        """Stacks the weights of ``experts``; returns the layer and how many were read from disk."""
        if len(experts) > self.capacity:
            raise SlotError(
                f"layer {layer}: {len(experts)} slots exceed this server's capacity {self.capacity}"
            )
        have = {e: s for s, e in enumerate(reuse.experts)} if reuse is not None else {}
        w13, w2, read = [], [], 0
        for e in experts:
            if e in have:
                w13.append(reuse.w13[have[e]])  # type: ignore[union-attr]
                w2.append(reuse.w2[have[e]])  # type: ignore[union-attr]
                continue
            if self.read_expert is not None:
                a, b = self.read_expert(layer, e)
                w13.append(a)
                w2.append(b)
                read += 1
                continue
            w = self.reader.expert_weights(layer, e)
            p13, p2 = self.pack(
                w.w13.to(self.device, self.dtype)[None], w.w2.to(self.device, self.dtype)[None]
            )
            w13.append(p13[0])
            w2.append(p2[0])
            read += 1
        if not experts:
            return self._empty(), 0
        return LayerSlots(tuple(experts), *self.stack(w13, w2)), read

    def preload(self, experts: list[int]) -> int:
        """Generation 0: the same experts in every MoE layer (start-up, before any placement)."""
        layers, read = {}, 0
        for layer in self.moe_layers:
            layers[layer], n = self._build(layer, experts, None)
            read += n
        self.live = SlotSet(0, layers)
        return read

    def prepare(self, generation: int, table: dict[int, list[int]]) -> int:
        if generation > MAX_GENERATION:
            raise SlotError(
                f"placement generation {generation} is above the largest allowed, {MAX_GENERATION}"
            )
        if generation <= self.live.generation:
            raise StaleGeneration(
                f"generation {generation} is not newer than the live {self.live.generation}"
            )
        unknown = set(table) - set(self.moe_layers)
        if unknown:
            raise SlotError(f"layers {sorted(unknown)} are not MoE layers (MoE layers: {self.moe_layers})")
        layers, read = {}, 0
        live = self.live
        for layer in self.moe_layers:
            layers[layer], n = self._build(layer, table.get(layer, []), live.layers.get(layer))
            read += n
        with self._lock:
            self._staged = SlotSet(generation, layers)
        return read

    def commit(self, generation: int) -> None:
        with self._lock:
            if self._staged is None or self._staged.generation != generation:
                staged = None if self._staged is None else self._staged.generation
                raise StaleGeneration(
                    f"no prepared placement of generation {generation} (prepared: {staged})"
                )
            self.live, self._staged = self._staged, None

    def abort(self, generation: int) -> None:
        with self._lock:
            if self._staged is not None and self._staged.generation == generation:
                self._staged = None
