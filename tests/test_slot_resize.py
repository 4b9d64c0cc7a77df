"""Resizes of a layer's slot table: within its allocation only the changed slots are written
(no new allocation, the live count moves); past it the new allocation is built during prepare
and the commit only swaps it in; spare slots past the target are trimmed; an abort leaves the
live placement intact. After any sequence of changes every layer computes as a fresh load of
the same placement and as plain torch on the checkpoint's weights, and a change never holds
more than the staging budget beyond the live allocations. Also the CPU server's int8/int4
packed slots, and LoRA following experts moved by a resize."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cpu_expert_server.backend import CpuExpertBackend
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference
from expertmesh.lora.store import LayerAdapter
from expertmesh.lora.wire import decode_adapter, encode_adapter
from expertmesh.worker.budget import WAITING_SPARE, plan_change
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.server import slot_table
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest
from tests.test_slot_moves import two_expert_lora

H, INTER, EXPERTS, LAYERS = 8, 4, 10, (0, 2)
SLOT = (3 * H * INTER) * 4  # one float32 slot: w13 [2I, H] + w2 [H, I]


class RandomReader:
    """Expert ``e`` of layer ``l``: random weights fixed by (l, e); records every read."""

    def __init__(self, h: int = H, inter: int = INTER) -> None:
        self.config = SimpleNamespace(
            hidden_size=h, moe_intermediate_size=inter, moe_layer_ids=list(LAYERS), num_experts=EXPERTS
        )
        self.reads: list[tuple[int, int]] = []

    def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
        self.reads.append((layer, e))
        return SimpleNamespace(
            **ref_weights(layer, e, self.config.hidden_size, self.config.moe_intermediate_size)
        )


def ref_weights(layer: int, e: int, h: int = H, inter: int = INTER) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * layer + e)
    return {"w13": torch.randn(2 * inter, h, generator=g), "w2": torch.randn(h, inter, generator=g)}


class Recording(SlotTable):
    """Notes every new allocation it builds: (phase, layer, slots)."""

    phase = "prepare"

    def _build(self, layer, sources, pool=None, slots=0):
        w13, w2 = super()._build(layer, sources, pool, slots)
        self.builds.append((self.phase, layer, w13.shape[0]))
        return w13, w2

    def commit(self, generation: int) -> None:
        self.phase = "commit"
        try:
            super().commit(generation)
        finally:
            self.phase = "prepare"


def table(
    capacity: int = 8, staging: int | None = None, spare: int | None = None
) -> tuple[Recording, RandomReader]:
    r = RandomReader()
    t = Recording(r, torch.float32, torch.device("cpu"), capacity, staging_bytes=staging, spare_bytes=spare)  # type: ignore[arg-type]
    t.builds = []
    return t, r


def push(t: SlotTable, gen: int, placement: dict[int, list[int]]) -> None:
    t.prepare(gen, placement)
    t.commit(gen)


def outputs(t: SlotTable, layer: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table's answer, plain torch on the checkpoint's experts) for random tokens."""
    ls = t.live.layers[layer]
    s = len(ls.experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=g)
    slot_ids = torch.randint(0, s, (6, 2), generator=g, dtype=torch.int32) if s else torch.full((6, 2), -1)
    weights = torch.rand(6, 2, generator=g)
    out = TorchExpertBackend().forward(x, ls.w13, ls.w2, slot_ids, weights)
    ref13 = torch.stack([ref_weights(layer, e)["w13"] for e in range(EXPERTS)])
    ref2 = torch.stack([ref_weights(layer, e)["w2"] for e in range(EXPERTS)])
    held = torch.tensor([*ls.experts, -1], dtype=torch.long)  # -1: the pick of an empty layer
    experts = held[torch.where(slot_ids >= 0, slot_ids.long(), s)]
    return out, torch_moe(x, ref13, ref2, experts, weights)


def same_as_fresh_load(t: SlotTable, placement: dict[int, list[int]]) -> None:
    fresh, _ = table(capacity=t.capacity)
    push(fresh, 1, placement)
    for layer in LAYERS:
        assert t.live.layers[layer].experts == tuple(placement.get(layer, []))
        out, ref = outputs(t, layer, seed=layer)
        assert torch.equal(out, outputs(fresh, layer, seed=layer)[0])
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_resize_within_the_allocation_writes_only_the_changed_slots():
    t, r = table()  # capacity 8: the budget is 8 slots, 4 of them spare: 2 per layer
    t.preload([0, 1, 2, 3])
    assert all(ls.allocated == 6 for ls in t.live.layers.values())
    slot = t.slot_bytes()
    assert t.resident_bytes() == 2 * 6 * slot  # spare slots count as resident
    ptrs = {layer: ls.w13.data_ptr() for layer, ls in t.live.layers.items()}
    t.builds.clear()
    r.reads.clear()
    placement = {0: [0, 1, 2, 3, 4, 5], 2: [3, 0]}  # grows into its spare slots / shrinks
    t.prepare(1, placement)
    # the new slots past the live ones are read in place by the prepare: nothing is staged and
    # the live layer still computes on its 4 slots
    assert sorted(r.reads) == [(0, 4), (0, 5)] and t._staged is not None and t._staged.rows == {}
    assert t.live.layers[0].experts == (0, 1, 2, 3) and t.resident_bytes() == 2 * 6 * slot
    t.commit(1)
    assert t.builds == [] and sorted(r.reads) == [(0, 4), (0, 5)]
    assert {layer: ls.w13.data_ptr() for layer, ls in t.live.layers.items()} == ptrs
    assert [ls.allocated for ls in t.live.layers.values()] == [6, 6]
    assert t.resident_bytes() == 2 * 6 * slot
    same_as_fresh_load(t, placement)
    # and back: the shrunk layer grows again inside its allocation
    r.reads.clear()
    placement = {0: [5, 4, 0, 1], 2: [3, 0, 7, 8, 1]}
    push(t, 2, placement)
    assert t.builds == [] and sorted(r.reads) == [(2, 1), (2, 7), (2, 8)]
    same_as_fresh_load(t, placement)
    # a push equal to the live placement touches nothing
    before = {layer: (ls.w13, ls.w2) for layer, ls in t.live.layers.items()}
    r.reads.clear()
    push(t, 3, placement)
    assert r.reads == [] and t.builds == []
    assert all(t.live.layers[la].w13 is before[la][0] for la in LAYERS)


def test_growth_past_the_allocation_is_built_in_prepare_and_swapped_in_by_the_commit():
    t, r = table(staging=16 * SLOT, spare=4 * SLOT)  # room for 12 slots beyond the 4 spare
    t.preload([0, 1, 2, 3])
    t.builds.clear()
    placement = {0: list(range(8)), 2: [3, 2, 1, 0]}  # layer 0 needs 8 slots, holds 6
    t.prepare(1, placement)
    staged = t._staged
    assert staged is not None and t.builds == [("prepare", 0, 8)]
    new13 = staged.built[0].w13
    assert t.live.layers[0].experts == (0, 1, 2, 3)  # nothing live changed yet
    t.commit(1)
    assert t.builds == [("prepare", 0, 8)]  # the commit built nothing
    assert t.live.layers[0].w13 is new13 and t.live.layers[0].allocated == 8
    same_as_fresh_load(t, placement)


def test_abort_after_a_prepared_growth_leaves_the_live_placement():
    t, _ = table(staging=16 * SLOT, spare=4 * SLOT)
    t.preload([0, 1, 2, 3])
    live, base = t.live, t.resident_bytes()
    before = outputs(t, 0)[0]
    t.prepare(1, {0: list(range(8)), 2: [5, 6]})
    assert t.resident_bytes() > base  # the built layer and the staged reads
    t.abort(1)
    assert t.live is live and t.resident_bytes() == base
    assert torch.equal(outputs(t, 0)[0], before)
    same_as_fresh_load(t, {0: [0, 1, 2, 3], 2: [0, 1, 2, 3]})


def test_abort_after_the_prepare_wrote_spare_slots_leaves_the_live_placement():
    t, _ = table()
    t.preload([0, 1, 2, 3])  # allocations of 6
    before = [outputs(t, layer)[0] for layer in LAYERS]
    t.prepare(1, {0: [0, 1, 2, 3, 7, 8], 2: [0, 1, 2, 3, 9]})
    t.abort(1)
    assert all(torch.equal(outputs(t, layer)[0], b) for layer, b in zip(LAYERS, before))
    placement = {0: [0, 1, 2, 3, 5], 2: [4, 1, 2, 3, 6]}  # the same spare slots, other experts
    push(t, 2, placement)
    same_as_fresh_load(t, placement)


def test_spare_slots_past_the_target_are_trimmed():
    t, _ = table()  # budget 8 slots, spare target 4 (2 per layer)
    t.preload([0, 1, 2, 3, 4, 5])  # allocations of 8 = 6 + 2
    slot = t.slot_bytes()
    t.builds.clear()
    placement = {0: [5], 2: [4]}
    # 14 spare slots: both layers are trimmed to 1 + 2; the first fits the room the 4 spare
    # slots leave in the budget and is built during prepare, the second is built by the commit
    push(t, 1, placement)
    assert t.builds == [("prepare", 0, 3), ("commit", 2, 3)]
    assert [t.live.layers[la].allocated for la in LAYERS] == [3, 3] and t.resident_bytes() == 6 * slot
    same_as_fresh_load(t, placement)
    t.builds.clear()
    placement = {0: [5, 6], 2: [4, 4, 7]}  # grows back into the spare slots: no allocation
    push(t, 2, placement)
    assert t.builds == [] and t.resident_bytes() == 6 * slot
    same_as_fresh_load(t, placement)


def test_plan_change_lays_out_in_place_growth_staged_builds_and_trims():
    live, alloc = {0: (0, 1, 2), 1: (0, 1, 2)}, {0: 4, 1: 4}
    # growth within the allocation is in place; past it a new allocation (headroom 1 per layer)
    lay = plan_change(live, alloc, {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4)}, 8, 9, 2)  # room 9 - 2
    assert lay.plans[0].rebuild is None and lay.plans[0].reads == ((3, 3),)
    assert lay.plans[1].rebuild == 6 and lay.built == {1}
    assert lay.staged == set() and lay.direct == {(0, 3)}  # past the live slots: written in place
    # room for 7 - 2 (spare held) = 5 slots: its exact size fits, not 6 with headroom
    lay = plan_change(live, alloc, {0: (0, 1, 2), 1: (0, 1, 2, 3, 4)}, 8, 7, 2)
    assert lay.plans[1].rebuild == 5 and lay.built == {1}
    # with no room the growth is rebuilt in the commit instead
    lay = plan_change(live, alloc, {0: (0, 1, 2, 3), 1: (0, 1, 2, 3, 4)}, 8, 0, 0)
    assert lay.plans[1].rebuild == 5 and lay.built == set() and lay.staged == set()
    # a table that places memory by slot count: every resize is a new allocation
    lay = plan_change({0: (0, 1)}, {0: 2}, {0: (1,)}, 8, 8, 4, exact=True)
    assert lay.plans[0].rebuild == 1 and lay.built == {0}
    # an equal push trims nothing, whatever spare it holds
    lay = plan_change({0: (0,)}, {0: 8}, {0: (0,)}, 8, 8, 0)
    assert lay.plans[0].unchanged and lay.built == set()


def test_trims_come_after_staged_reads_and_wait_for_room():
    """Reads are staged before any trim is built (they keep the commit short); a trim that the
    room left cannot build waits for a later change while the spare slots stay within
    WAITING_SPARE of the budget, and is rebuilt by the commit past that."""
    live, alloc = {0: tuple(range(8)), 1: tuple(range(6))}, {0: 8, 1: 8}
    table = {0: (9, 1, 2, 3, 4), 1: (9,)}
    # budget 8, 2 spare held: room 6; the two reads staged, layer 1 trimmed to 1 + 1 (its read
    # goes into the build), layer 0's trim (6 slots) does not fit and waits: 4 spare slots left
    lay = plan_change(live, alloc, table, 8, 8, 2)
    assert lay.built == {1} and lay.plans[1].rebuild == 2
    assert lay.plans[0].rebuild is None and lay.staged == {(0, 0)}
    # budget 5: 4 spare slots would pass 0.75 x 5, so the commit rebuilds layer 0
    lay = plan_change(live, alloc, table, 8, 5, 2)
    assert lay.built == {1} and lay.plans[0].rebuild == 6 and WAITING_SPARE * 5 < 4


@pytest.mark.parametrize("staging_slots", [0, 3, None])
def test_random_changes_compute_as_a_fresh_load_within_the_budget(staging_slots):
    rng = random.Random(staging_slots or 7)
    capacity = 7
    t, _ = table(capacity=capacity)
    slot = t.slot_bytes()
    if staging_slots is not None:
        t.staging_bytes = staging_slots * slot
    budget = (capacity if staging_slots is None else staging_slots) * slot
    t.preload(rng.sample(range(EXPERTS), 4))
    for gen in range(1, 16):
        placement = {
            layer: [rng.randrange(EXPERTS) for _ in range(rng.randint(0 if gen % 5 == 0 else 1, capacity))]
            for layer in LAYERS
        }
        before = t.resident_bytes()
        t.peak_bytes = 0
        push(t, gen, placement)
        # a change adds at most the budget to what is held before or after it (or one layer
        # rebuilt in the commit, where the budget is below a layer)
        held = max(before, t.resident_bytes())
        assert t.peak_bytes <= held + max(budget, capacity * slot), (gen, t.peak_bytes, before)
        # and between changes the spare slots stay within their target, half the budget, or
        # within WAITING_SPARE of it while trims that found no room wait for a later change
        experts = sum(len(ls.experts) for ls in t.live.layers.values()) * slot
        assert t.resident_bytes() - experts <= budget * WAITING_SPARE, (gen, t.resident_bytes(), experts)
        same_as_fresh_load(t, placement)


def test_lora_follows_experts_moved_by_a_resize():
    t, _ = table()
    w = ExpertWorker(t, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"), max_loras=2)
    t.preload([3, 1])
    g = torch.Generator().manual_seed(0)
    lora = two_expert_lora(g, H, INTER)  # experts (1, 3) of layer 2, sorted
    msg = encode_adapter({2: LayerAdapter((1, 3), lora)}, torch.float32)
    w.load_adapter(5, "a", decode_adapter(msg, H, INTER, EXPERTS, list(LAYERS), torch.float32))
    hidden = torch.randn(3, H, generator=g) / 10
    slot_ids = torch.tensor([[0, 1], [1, 2], [2, -1]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=g)
    adapters = torch.tensor([5, 5, -1], dtype=torch.int32)
    first = torch.tensor([[0, 1], [1, -1], [0, -1]], dtype=torch.int32)
    w.compute(w.check(ExpertRequest(1, 0, 2, hidden, first, weights, adapters)))  # buffers resident
    w.prepare(1, {0: [3, 1], 2: [1, 7, 3]})  # grows into a spare slot, expert 1 moves to slot 0
    w.commit(1)
    live = t.live.layers[2]
    assert live.experts == (1, 7, 3) and live.allocated == 4
    out = w.compute(w.check(ExpertRequest(1, 1, 2, hidden, slot_ids, weights, adapters)))
    parts = (lora.a13, lora.b13, lora.a2, lora.b2)
    # slots hold experts 1, 7 (the adapter leaves it alone: zeros), 3
    per_slot = ExpertLoRA(*(torch.cat([a[0:1], torch.zeros_like(a[:1]), a[1:2]]) for a in parts))
    stacked = MoELoRAWeights.stack([per_slot])
    ref = moe_lora_reference(hidden, live.w13, live.w2, slot_ids, weights, stacked, torch.tensor([0, 0, -1]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wdtype", ["int8", "int4"])
def test_cpu_server_packed_slots_resize_as_a_fresh_load(wdtype):
    """The CPU server's quantised tables keep a slot per row of dim 0: views of the allocation
    compute as a fresh table's, bit for bit."""
    h, inter = 64, 32

    def cpu_table() -> tuple[SlotTable, CpuExpertBackend]:
        b = CpuExpertBackend(threads=1, weight_dtype=wdtype, group=32)
        return slot_table(RandomReader(h, inter), b, torch.float32, torch.device("cpu"), 6), b  # type: ignore[arg-type]

    t, b = cpu_table()
    t.preload([0, 1, 2])
    assert t.live.layers[0].allocated == 4  # 3 + 1: the budget (6 slots) keeps 3 spare over 2 layers
    steps = [{0: [2, 1, 0, 5], 2: [1]}, {0: [2, 5, 6, 7, 8, 0], 2: [1, 9, 4]}, {0: [8], 2: [4, 9, 1, 3]}]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, h, generator=g)
    for gen, placement in enumerate(steps, 1):
        push(t, gen, placement)
        fresh, fb = cpu_table()
        push(fresh, 1, placement)
        for layer in LAYERS:
            ls, fs = t.live.layers[layer], fresh.live.layers[layer]
            assert ls.experts == fs.experts
            s = len(ls.experts)
            slot_ids = torch.randint(0, s, (5, 2), generator=g, dtype=torch.int32)
            weights = torch.rand(5, 2, generator=g)
            out = b.forward(x, ls.w13, ls.w2, slot_ids, weights)
            assert torch.equal(out, fb.forward(x, fs.w13, fs.w2, slot_ids, weights))
            assert torch.equal(ls.w13, fs.w13) and torch.equal(ls.w2, fs.w2)


def test_no_spare_slots_every_resize_is_a_new_allocation_built_in_prepare():
    t, _ = table(spare=0)  # --placement-spare-mb 0
    t.preload([0, 1, 2])
    assert [t.live.layers[la].allocated for la in LAYERS] == [3, 3]
    t.builds.clear()
    placement = {0: [0, 1], 2: [0, 1, 2, 3]}
    push(t, 1, placement)
    assert sorted(t.builds) == [("prepare", 0, 2), ("prepare", 2, 4)]
    assert t.resident_bytes() == 6 * SLOT
    same_as_fresh_load(t, placement)


@pytest.mark.gpu
def test_gpu_server_tables_resize_as_a_fresh_load_under_cuda_graphs():
    """On the GPU the graphs are keyed by the layer's allocation: a table resized inside it
    keeps its graphs (no capture on the next request) and computes as a fresh load."""
    from gpu_server.backend import TritonExpertBackend
    from gpu_server.graphs import GraphedBackend

    dev, h, inter = torch.device("cuda"), 128, 64
    backend = GraphedBackend(TritonExpertBackend.for_device(dev))

    def gpu_table() -> SlotTable:
        return slot_table(RandomReader(h, inter), backend, torch.bfloat16, dev, 8)  # type: ignore[arg-type]

    t = gpu_table()
    t.preload([0, 1, 2, 3])
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    kept = 0  # requests on a layer whose allocation the push kept, served by an existing graph
    for gen in range(1, 8):
        placement = {layer: [rng.randrange(EXPERTS) for _ in range(rng.randint(1, 8))] for layer in LAYERS}
        allocs = {layer: t.live.layers[layer].rows[0].data_ptr() for layer in LAYERS}
        push(t, gen, placement)
        fresh = gpu_table()
        push(fresh, 1, placement)
        for layer in LAYERS:
            ls, fs = t.live.layers[layer], fresh.live.layers[layer]
            assert ls.experts == fs.experts == tuple(placement[layer])
            x = torch.randn(3, h, generator=g).to(dev, torch.bfloat16)  # decode-sized: graphed
            slot_ids = torch.randint(0, len(ls.experts), (3, 2), generator=g, dtype=torch.int32)
            weights = torch.rand(3, 2, generator=g)
            graphs = len(backend._graphs)
            out = backend.forward(x, ls.w13, ls.w2, slot_ids, weights)
            if gen > 1 and ls.rows[0].data_ptr() == allocs[layer]:
                assert len(backend._graphs) == graphs, (gen, layer)
                kept += 1
            assert torch.equal(out, backend.forward(x, fs.w13, fs.w2, slot_ids, weights))
            w = [ref_weights(layer, e, h, inter) for e in ls.experts]
            w13 = torch.stack([a["w13"] for a in w]).bfloat16().float()
            w2 = torch.stack([a["w2"] for a in w]).bfloat16().float()
            ref = torch_moe(x.float().cpu(), w13, w2, slot_ids, weights)
            torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    assert kept > 0
