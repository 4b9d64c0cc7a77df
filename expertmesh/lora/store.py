"""An expert server's MoE-LoRA adapters: host copies of every adapter pushed to it, and at most
``max_loras`` of them resident in fixed device buffers (least recently used evicted, reloaded
from the host copy on demand).

Adapters are keyed by the coordinator's adapter id (the value carried per token in
``adapter_slots``) and kept per LOGICAL expert, so a placement change needs no new push: the
device buffers of a layer are gathered for the slot table they are used with (``experts``: the
logical expert of each local slot) and rebuilt when that table changes. A server keeps LoRA
only for the experts it was sent (those it may hold); others read as zero.

Shapes: S local slots, E' experts of an adapter's copy, L = max_loras, T tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from expertmesh.lora.moe import ExpertLoRA, MoELoRAWeights


class AdapterStoreError(ValueError):
    """A request names an adapter this server does not have, or too many at once."""


@dataclass(frozen=True)
class LayerAdapter:
    experts: tuple[int, ...]  # [E'] logical experts this copy covers
    lora: ExpertLoRA  # rows follow ``experts``; host memory, server dtype


@dataclass
class _Resident:
    experts: tuple[int, ...]  # the slot table the buffers were gathered for
    weights: MoELoRAWeights  # [L, S, ...]


class AdapterStore:
    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        if max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        self.max_loras, self.dtype, self.device = max_loras, dtype, device
        self.adapters: dict[int, tuple[str, dict[int, LayerAdapter]]] = {}  # id -> (name, layers)
        self._lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> buffer index, oldest first
        self._resident: dict[int, _Resident] = {}  # layer -> buffers
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- pushes

    def add(self, adapter_id: int, name: str, layers: dict[int, LayerAdapter]) -> None:
        """Keeps a host copy; replaces an adapter of the same id (its resident copy is dropped)."""
        host = {
            layer: LayerAdapter(la.experts, la.lora.to("cpu", self.dtype)) for layer, la in layers.items()
        }
        with self._lock:
            self._drop(adapter_id)
            self.adapters[adapter_id] = (name, host)

    def remove(self, adapter_id: int) -> bool:
        with self._lock:
            found = self.adapters.pop(adapter_id, None) is not None
            self._drop(adapter_id)
            return found

    def names(self) -> dict[int, str]:
        return {i: n for i, (n, _) in self.adapters.items()}

    def _drop(self, adapter_id: int) -> None:
        index = self._lru.pop(adapter_id, None)
        if index is not None:
            for res in self._resident.values():
                res.weights.clear(index)

    # ---------------------------------------------------------------- forward

    def resolve(self, token_adapter: torch.Tensor) -> dict[int, int]:
        """Makes every adapter id in ``token_adapter [T]`` (-1 = base) resident; returns
        {adapter id: buffer index}. Evicts the least recently used ids not in this batch."""
        ids = sorted(set(token_adapter[token_adapter >= 0].tolist()))
        with self._lock:
            unknown = [i for i in ids if i not in self.adapters]
            if unknown:
                raise AdapterStoreError(f"adapter slot(s) {unknown} not loaded on this server")
            if len(ids) > self.max_loras:
                raise AdapterStoreError(
                    f"{len(ids)} adapters in one request, more than --max-loras {self.max_loras}"
                )
            for i in ids:
                if i in self._lru:
                    self._lru.move_to_end(i)
                    continue
                used = set(self._lru.values())
                free = [b for b in range(self.max_loras) if b not in used]
                if not free:
                    victim = next(v for v in self._lru if v not in ids)
                    free = [self._lru.pop(victim)]
                self._lru[i] = free[0]
                self._load(i, free[0])
            return {i: self._lru[i] for i in ids}

    def buffer_index(self, token_adapter: torch.Tensor) -> torch.Tensor:
        """``token_adapter [T]`` adapter ids -> buffer indices [T] (-1 stays -1)."""
        where = self.resolve(token_adapter)
        out = torch.full_like(token_adapter, -1)
        for i, b in where.items():
            out[token_adapter == i] = b
        return out

    def weights(self, layer: int, experts: tuple[int, ...]) -> MoELoRAWeights | None:
        """The resident buffers of ``layer`` for slot table ``experts`` (rebuilt if it changed)."""
        with self._lock:
            res = self._resident.get(layer)
            if res is None or res.experts != experts or not self._fits(layer, res):
                res = self._gather(layer, experts)
                if res is None:
                    return None
                self._resident[layer] = res
            return res.weights

    def _ranks(self, layer: int) -> tuple[int, int] | None:
        ranks = [la[layer].lora.ranks for _, la in self.adapters.values() if layer in la]
        if not ranks:
            return None
        return max(r[0] for r in ranks), max(r[1] for r in ranks)

    def _fits(self, layer: int, res: _Resident) -> bool:
        r = self._ranks(layer)
        return r is None or (res.weights.a13.shape[2] >= r[0] and res.weights.a2.shape[2] >= r[1])

    def _gather(self, layer: int, experts: tuple[int, ...]) -> _Resident | None:
        ranks = self._ranks(layer)
        if ranks is None:
            return None
        any_copy = next(la[layer].lora for _, la in self.adapters.values() if layer in la)
        hidden, inter = any_copy.a13.shape[2], any_copy.a2.shape[2]
        w = MoELoRAWeights.zeros(self.max_loras, len(experts), hidden, inter, *ranks, self.dtype, self.device)
        res = _Resident(experts, w)
        self._resident[layer] = res
        for adapter_id, index in self._lru.items():
            self._put(adapter_id, index, layer, res)
        return res

    def _load(self, adapter_id: int, index: int) -> None:
        for layer, res in self._resident.items():
            res.weights.clear(index)
            self._put(adapter_id, index, layer, res)

    def _put(self, adapter_id: int, index: int, layer: int, res: _Resident) -> None:
        la = self.adapters[adapter_id][1].get(layer)
        if la is None:
            return
        row = {e: r for r, e in enumerate(la.experts)}
        for s, e in enumerate(res.experts):
            r = row.get(e)
            if r is None:
                continue
            one = ExpertLoRA(
                la.lora.a13[r : r + 1], la.lora.b13[r : r + 1], la.lora.a2[r : r + 1], la.lora.b2[r : r + 1]
            )
            p = one.padded(res.weights.a13.shape[2], res.weights.a2.shape[2]).to(self.device, self.dtype)
            res.weights.a13[index, s].copy_(p.a13[0])
            res.weights.b13[index, s].copy_(p.b13[0])
            res.weights.a2[index, s].copy_(p.a2[0])
            res.weights.b2[index, s].copy_(p.b2[0])
