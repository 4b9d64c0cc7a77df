"""The expert server's slot table on a fake checkpoint: preload, two-phase placement (weights
reused, only new experts read), typed errors; and the expert-range parser."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from expertmesh import errors
from expertmesh.worker.slots import SlotError, SlotTable, parse_expert_spec

H, INTER = 4, 2


class FakeReader:
    """Expert ``e`` of layer ``l`` is filled with ``100 * l + e`` (so a slot says what it holds)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(
            hidden_size=H, moe_intermediate_size=INTER, moe_layer_ids=[0, 2], num_experts=4
        )
        self.reads: list[tuple[int, int]] = []

    def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
        self.reads.append((layer, e))
        v = float(100 * layer + e)
        return SimpleNamespace(w13=torch.full((2 * INTER, H), v), w2=torch.full((H, INTER), v))


def table(capacity: int = 4) -> tuple[SlotTable, FakeReader]:
    r = FakeReader()
    return SlotTable(r, torch.float32, torch.device("cpu"), capacity), r  # type: ignore[arg-type]


def held(t: SlotTable, layer: int) -> list[float]:
    """The value each slot's weights carry, from w13 and w2 (which must agree)."""
    ls = t.live.layers[layer]
    a, b = ls.w13[:, 0, 0].tolist(), ls.w2[:, 0, 0].tolist()
    assert a == b
    return a


def test_starts_empty_then_preloads_every_layer():
    t, r = table()
    assert t.live.generation == 0 and all(ls.experts == () for ls in t.live.layers.values())
    assert tuple(t.live.layers[0].w13.shape) == (0, 2 * INTER, H)
    assert t.preload([1, 3]) == 4 and sorted(r.reads) == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert t.live.layers[2].experts == (1, 3) and held(t, 2) == [201.0, 203.0]


def test_prepare_reuses_resident_weights_and_commit_swaps():
    t, r = table()
    t.preload([1, 3])
    r.reads.clear()
    # layer 0: 3 resident, 0 new; layer 2: 1 resident, 1 twice (a replica); no read for reuse
    assert t.prepare(1, {0: [3, 0], 2: [1, 1]}) == 1 and r.reads == [(0, 0)]
    assert t.live.generation == 0 and t.live.layers[0].experts == (1, 3)  # not live before commit
    t.commit(1)
    assert t.live.generation == 1
    assert t.live.layers[0].experts == (3, 0) and held(t, 0) == [3.0, 0.0]
    assert t.live.layers[2].experts == (1, 1) and held(t, 2) == [201.0, 201.0]
    # a layer the table leaves out holds nothing
    t.prepare(2, {0: [2]})
    t.commit(2)
    assert t.live.layers[2].experts == () and held(t, 0) == [2.0]


def test_abort_and_generation_errors_are_typed():
    t, _ = table()
    t.prepare(3, {0: [0]})
    t.abort(3)
    with pytest.raises(errors.StaleGeneration, match="no prepared placement of generation 3"):
        t.commit(3)
    t.prepare(3, {0: [0]})
    with pytest.raises(errors.StaleGeneration, match="prepared: 3"):
        t.commit(4)
    t.commit(3)
    with pytest.raises(errors.StaleGeneration, match="not newer than the live 3"):
        t.prepare(3, {0: [1]})
    assert errors.StaleGeneration.status == errors.FAILED_PRECONDITION


def test_capacity_and_unknown_layers_are_invalid():
    t, _ = table(capacity=2)
    with pytest.raises(SlotError, match="3 slots exceed this server's capacity 2"):
        t.prepare(1, {0: [0, 1, 2]})
    with pytest.raises(SlotError, match=r"layers \[1\] are not MoE layers"):
        t.prepare(1, {1: [0]})
    assert issubclass(SlotError, errors.InvalidRequest) and issubclass(SlotError, ValueError)
    # a bogus generation is refused before it can become live (the coordinator adds 1 to it)
    with pytest.raises(SlotError, match="above the largest allowed"):
        t.prepare(2**64 - 1, {0: [0]})
    assert t.live.generation == 0


def test_parse_expert_spec():
    assert parse_expert_spec("all", 4) == [0, 1, 2, 3]
    assert parse_expert_spec(" none ", 4) == [] and parse_expert_spec("", 4) == []
    assert parse_expert_spec("5,0-2,1", 8) == [0, 1, 2, 5]
    with pytest.raises(SlotError, match="outside"):
        parse_expert_spec("7-9", 8)
