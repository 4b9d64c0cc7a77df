"""Placement changes with bounded memory: per-layer move plans and their in-place order (checked
against simply building the new list), a push equal to the live placement touching nothing,
rebalances rewriting the live allocation in place, the staging budget, abort, a commit that
fails half-way, and LoRA adapters following experts that moved."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference
from expertmesh.lora.store import LayerAdapter
from expertmesh.lora.wire import decode_adapter, encode_adapter
from expertmesh.worker.budget import plan_change
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.moves import TEMP, move_order, plan_layer
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest
from tests.test_slots import INTER, FakeReader, H


def apply_plan(live: list[int], new: list[int]) -> list[int]:
    """Replays plan_layer + move_order on a list of slot contents, as the table does in place."""
    plan = plan_layer(tuple(live), tuple(new))
    slots, spare = list(live), None
    for op, dst, src in move_order(plan.moves):
        if op == "save":
            spare = slots[dst]
        else:
            slots[dst] = spare if src == TEMP else slots[src]
    for dst, e in plan.reads:
        slots[dst] = e
    return slots


def test_move_order_reproduces_every_new_table():
    rng = random.Random(0)
    for _ in range(500):
        s = rng.randint(1, 9)
        live = rng.sample(range(12), s)
        new = [rng.choice(live) if rng.random() < 0.7 else rng.randrange(12) for _ in range(s)]
        assert apply_plan(live, new) == new, (live, new)
    # a pure rotation is a cycle: one save, then copies only
    order = move_order(plan_layer((0, 1, 2, 3), (1, 2, 3, 0)).moves)
    assert [op for op, *_ in order].count("save") == 1 and len(order) == 5


def test_plan_of_an_equal_table_moves_nothing():
    p = plan_layer((4, 2, 7), (4, 2, 7))
    assert p.unchanged and not p.resize
    p = plan_layer((4, 2, 7), (2, 4, 7))
    assert sorted(p.moves) == [(0, 1), (1, 0)] and p.reads == ()
    p = plan_layer((4, 2), (4, 2, 9))
    assert p.resize and p.reads == ((2, 9),)


def test_plan_change_keeps_commit_within_the_budget():
    live, alloc = {0: (0, 1), 1: (0, 1), 2: ()}, {0: 2, 1: 2, 2: 0}
    new = {0: (2, 3), 1: (4, 1), 2: (5,)}

    def staged(budget: int) -> frozenset:
        lay = plan_change(live, alloc, new, 4, budget, 0)
        assert lay.built == lay.loads == {2}  # held nothing: built whole, outside the budget
        return lay.staged

    assert staged(0) == set()
    assert staged(2) == {(0, 0), (0, 1)}  # a third read would hold 3 slots
    assert staged(100) == {(0, 0), (0, 1), (1, 0)}


def table(capacity: int = 4, staging: int | None = None) -> tuple[SlotTable, FakeReader]:
    r = FakeReader()
    t = SlotTable(r, torch.float32, torch.device("cpu"), capacity, staging_bytes=staging)  # type: ignore[arg-type]
    return t, r


def values(t: SlotTable, layer: int) -> list[float]:
    ls = t.live.layers[layer]
    a, b = ls.w13[:, 0, 0].tolist(), ls.w2[:, -1, -1].tolist()
    assert a == b
    return a


def test_equal_push_touches_no_weight_and_rebalance_rewrites_in_place():
    t, r = table()
    t.preload([0, 1, 2, 3])
    before = {layer: (ls.w13, ls.w2) for layer, ls in t.live.layers.items()}
    copies = {layer: ls.w13.clone() for layer, ls in t.live.layers.items()}
    r.reads.clear()
    assert t.prepare(1, {0: [0, 1, 2, 3], 2: [0, 1, 2, 3]}) == 0
    t.commit(1)
    assert r.reads == [] and t.live.generation == 1
    for layer, ls in t.live.layers.items():
        assert ls.w13 is before[layer][0] and torch.equal(ls.w13, copies[layer])
    # layer 0 rotates (a cycle), layer 2 swaps one expert for one it does not hold: capacity 4
    # keeps the allocation, only the new expert is read
    t2 = SlotTable(r, torch.float32, torch.device("cpu"), 5)  # type: ignore[arg-type]
    t2.preload([0, 1, 2, 3])
    ptr = t2.live.layers[2].w13.data_ptr()
    r.reads.clear()
    assert t2.prepare(1, {0: [1, 2, 3, 0], 2: [0, 1, 4, 3]}) == 1 and r.reads == [(2, 4)]
    assert values(t2, 0) == [0.0, 1.0, 2.0, 3.0]  # nothing live moved before the commit
    t2.commit(1)
    assert values(t2, 0) == [1.0, 2.0, 3.0, 0.0] and values(t2, 2) == [200.0, 201.0, 204.0, 203.0]
    assert t2.live.layers[2].w13.data_ptr() == ptr
    # growing into the allocation's spare slot (capacity 5 keeps one per layer) rewrites in
    # place; a layer left out holds nothing (its allocation goes)
    ptr = t2.live.layers[0].w13.data_ptr()
    t2.prepare(2, {0: [3, 4, 1, 2, 0]})
    t2.commit(2)
    assert values(t2, 0) == [3.0, 4.0, 1.0, 2.0, 0.0] and t2.live.layers[0].w13.data_ptr() == ptr
    assert t2.live.layers[2].experts == () and t2.live.layers[2].allocated == 0


def test_budget_bounds_the_extra_bytes_and_unstaged_reads_happen_at_commit():
    t, r = table(staging=0)
    t.preload([0, 1, 2, 3])
    slot = t.slot_bytes()
    base = t.resident_bytes()
    t.peak_bytes = 0
    r.reads.clear()
    t.prepare(1, {0: [3, 2, 1, 0], 2: [0, 4, 5, 6]})
    assert r.reads == [] and t.resident_bytes() == base  # nothing read ahead with no budget
    t.commit(1)
    assert sorted(r.reads) == [(2, 4), (2, 5), (2, 6)]
    assert t.peak_bytes <= base + slot  # the spare slot of layer 0's swaps
    assert values(t, 0) == [3.0, 2.0, 1.0, 0.0] and values(t, 2) == [200.0, 204.0, 205.0, 206.0]
    # a budget of two slots: two reads ahead, the third at commit
    t, r = table(staging=2 * slot)
    t.preload([0, 1, 2, 3])
    r.reads.clear()
    t.prepare(1, {2: [7, 4, 5, 6]})
    assert len(r.reads) == 2 and t.resident_bytes() == base + 2 * slot
    t.commit(1)
    assert len(r.reads) == 4 and t.resident_bytes() == base // 2  # layer 0 was left out


def test_abort_leaves_the_live_table_and_frees_the_staging():
    t, _ = table(staging=1 << 20)
    t.preload([0, 1])
    live = t.live
    base = t.resident_bytes()
    t.prepare(1, {0: [2, 3], 2: [1, 0]})
    assert t.resident_bytes() > base
    t.abort(1)
    assert t.live is live and t.resident_bytes() == base and values(t, 0) == [0.0, 1.0]
    with pytest.raises(errors.StaleGeneration):
        t.commit(1)


class FailingReader(FakeReader):
    def __init__(self) -> None:
        super().__init__()
        self.fail: set[tuple[int, int]] = set()

    def expert_weights(self, layer: int, e: int):
        if (layer, e) in self.fail:
            raise OSError(f"disk gone reading expert {e} of layer {layer}")
        return super().expert_weights(layer, e)


class MeetingReader(FakeReader):
    """Reads of ``meet`` experts wait for each other: they complete only when run at once."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.meet: set[tuple[int, int]] = set()
        self.barrier = threading.Barrier(parties, timeout=10)
        self.threads: set[str] = set()

    def expert_weights(self, layer: int, e: int):
        if (layer, e) in self.meet:
            self.threads.add(threading.current_thread().name)
            self.barrier.wait()  # BrokenBarrierError (a RuntimeError): the reads ran one by one
        return super().expert_weights(layer, e)


def test_a_host_commit_rewrites_its_layers_at_once():
    r = MeetingReader(2)
    t = SlotTable(r, torch.float32, torch.device("cpu"), 4, staging_bytes=0)  # type: ignore[arg-type]
    t.preload([0, 1])
    t.prepare(1, {0: [0, 3], 2: [2, 1]})  # no staging: both reads happen in the commit
    assert t.last_prepare.startswith(
        "2 experts to read: 0 staged, 0 written into spare slots; 0 layers built"
    )
    r.meet = {(0, 3), (2, 2)}
    t.commit(1)
    assert len(r.threads) == 2 and threading.current_thread().name not in r.threads
    assert values(t, 0) == [0.0, 3.0] and values(t, 2) == [202.0, 201.0]
    assert (t.last_commit.read, t.last_commit.copied, t.last_commit.moved) == (2, 0, 0)


def test_a_commit_failing_half_way_refuses_requests_until_a_new_placement():
    r = FailingReader()
    t = SlotTable(r, torch.float32, torch.device("cpu"), 4, staging_bytes=0)  # type: ignore[arg-type]
    w = ExpertWorker(t, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"))
    t.preload([0, 1])
    w.prepare(1, {0: [1, 0], 2: [2, 3]})
    r.fail = {(2, 3)}
    with pytest.raises(errors.Unavailable, match="failed half-way"):
        w.commit(1)
    assert t.live.generation == 0 and t.live.layers[0].experts == (1, 0)
    held = t.live.layers[2].experts
    assert held[1] == -1 and held[0] in (2, -1)  # slots being written are unknown
    x = torch.randn(2, H)
    req = ExpertRequest(1, 0, 0, x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
    with pytest.raises(errors.Unavailable, match="failed half-way"):
        w.check(req)
    r.fail = set()
    r.reads.clear()
    w.prepare(2, {0: [1, 0], 2: [2, 3]})
    w.commit(2)
    assert sorted(r.reads) == [(2, e) for e, h in zip((2, 3), held) if h == -1]  # only the unknown
    assert values(t, 2) == [202.0, 203.0]
    req = ExpertRequest(1, 2, 2, x, torch.ones(2, 1, dtype=torch.int32), torch.ones(2, 1))
    ref = torch_moe(
        x, torch.full((1, 2 * INTER, H), 203.0), torch.full((1, H, INTER), 203.0),
        torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
    )  # fmt: skip
    assert torch.equal(w.compute(w.check(req)), ref)


def two_expert_lora(g: torch.Generator, h: int = H, inter: int = INTER) -> ExpertLoRA:
    """Random LoRA weights of two experts (rank 3 on gate/up, 2 on down) at widths ``h``, ``inter``."""
    return ExpertLoRA(
        torch.randn(2, 3, h, generator=g),
        torch.randn(2, 2 * inter, 3, generator=g),
        torch.randn(2, 2, inter, generator=g),
        torch.randn(2, h, 2, generator=g),
    )


def test_lora_follows_experts_moved_in_place():
    t, _ = table()
    w = ExpertWorker(t, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"), max_loras=2)
    w.prepare(1, {0: [3, 1], 2: [3, 1]})
    w.commit(1)
    g = torch.Generator().manual_seed(0)
    lora = two_expert_lora(g)  # experts (1, 3) of layer 2, sorted
    msg = encode_adapter({2: LayerAdapter((1, 3), lora)}, torch.float32)
    w.load_adapter(5, "a", decode_adapter(msg, H, INTER, 4, [0, 2], torch.float32))
    hidden = torch.randn(3, H, generator=g) / 100
    slot_ids = torch.tensor([[0, 1], [1, -1], [0, -1]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=g)
    adapters = torch.tensor([5, 5, -1], dtype=torch.int32)
    w.compute(w.check(ExpertRequest(1, 1, 2, hidden, slot_ids, weights, adapters)))  # buffers resident
    w.prepare(2, {0: [3, 1], 2: [1, 3]})  # the two experts swap slots in place
    w.commit(2)
    out = w.compute(w.check(ExpertRequest(1, 2, 2, hidden, slot_ids, weights, adapters)))
    live = t.live.layers[2]
    assert live.experts == (1, 3) and live.w13[0, 0, 0] == 201.0
    stacked = MoELoRAWeights.stack([lora.select([0, 1])])  # slot 0 now holds expert 1
    ref = moe_lora_reference(hidden, live.w13, live.w2, slot_ids, weights, stacked, torch.tensor([0, 0, -1]))
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


class BlockingReader(FakeReader):
    """Its reads wait for ``go`` once ``armed`` (a commit reading from the checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.inside, self.go = threading.Event(), threading.Event()

    def expert_weights(self, layer: int, e: int):
        if self.armed:
            self.inside.set()
            assert self.go.wait(10)
        return super().expert_weights(layer, e)


def test_a_request_checked_during_a_commit_is_stale():
    r = BlockingReader()
    t = SlotTable(r, torch.float32, torch.device("cpu"), 4, staging_bytes=0)  # type: ignore[arg-type]
    w = ExpertWorker(t, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"))
    t.preload([0, 1])
    w.prepare(1, {0: [1, 0], 2: [2, 3]})
    r.armed = True
    commit = threading.Thread(target=w.commit, args=(1,))
    commit.start()
    try:
        assert r.inside.wait(10)
        x = torch.randn(2, H)
        req = ExpertRequest(1, 0, 0, x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
        with pytest.raises(errors.StaleGeneration, match="generation 0 is being replaced"):
            w.check(req)
    finally:
        r.go.set()
        commit.join(10)
    assert t.live.generation == 1 and not t.live.committing and values(t, 2) == [202.0, 203.0]


def test_what_a_commit_replaces_is_freed_by_release_not_inside_the_commit():
    import weakref

    r = FakeReader()
    # no spare slots: the preload allocates one slot a layer, so growing builds new allocations
    t = SlotTable(r, torch.float32, torch.device("cpu"), 4, staging_bytes=1 << 20, spare_bytes=0)  # type: ignore[arg-type]
    t.preload([0])
    gone = weakref.ref(t.live.layers[0].rows[0])
    t.prepare(1, {0: [0, 1, 2, 3], 2: [3, 2, 1, 0]})
    assert "; 2 layers built" in t.last_prepare
    t.commit(1)
    assert t.live.layers[0].rows[0] is not gone() is not None  # replaced, and held past the commit
    assert t.last_commit.swapped == 2 and t.last_commit.read == 0  # both layers built by prepare
    t.release()
    assert gone() is None
    assert values(t, 0) == [0.0, 1.0, 2.0, 3.0] and values(t, 2) == [203.0, 202.0, 201.0, 200.0]


def test_a_host_commit_copies_staged_experts_one_slot_per_job(monkeypatch):
    """A CPU server's commit copies each staged expert as its own job (a rebalance that changes
    many slots of one layer spreads over the commit threads), and the layer computes its new
    experts afterwards."""
    from expertmesh.worker import slots as slots_mod

    r = FakeReader()
    t = SlotTable(r, torch.float32, torch.device("cpu"), 6, staging_bytes=1 << 20)  # type: ignore[arg-type]
    t.preload([0, 1, 2, 3])
    jobs: list[tuple[int, str]] = []
    run = slots_mod._Copy.run

    def recorded(c: slots_mod._Copy) -> None:
        jobs.append((c.layer, threading.current_thread().name))
        run(c)

    monkeypatch.setattr(slots_mod._Copy, "run", recorded)
    t.prepare(1, {0: [4, 5, 6, 3], 2: [0, 1, 2, 3]})
    t.commit(1)
    assert t.last_commit.copied == 3 and [layer for layer, _ in jobs] == [0, 0, 0]
    assert values(t, 0) == [4.0, 5.0, 6.0, 3.0] and values(t, 2) == [200.0, 201.0, 202.0, 203.0]
    assert t.live.layers[0].experts == (4, 5, 6, 3)


def test_drop_pages_returns_only_storages_nothing_else_holds():
    """Freed weights go back page by page before the free, but a storage that anything else
    still holds (a view, the storage itself) keeps its contents."""
    from expertmesh.worker import memory

    page_multiple = 3 * memory.RELEASE_CHUNK // 4 + 4096  # spans chunks unevenly
    alone = torch.full((page_multiple * 2 // 4,), 7.0)  # 2x: more than one chunk
    viewed = torch.full((page_multiple // 4,), 5.0)
    kept_view = viewed[10:20]  # held elsewhere: must survive
    stored = torch.full((page_multiple // 4,), 3.0)
    kept_storage = stored.untyped_storage()
    a_view_of_alone = alone[:100]  # a second tensor in the list on the same storage
    assert memory.sole_storages([torch.ones(4096)])  # the pinned torch counts a storage's holders
    dropped = memory.drop_pages([alone, a_view_of_alone, viewed, stored])
    # whole pages inside the storage only; glibc/torch may put its start anywhere in a page
    assert alone.nbytes - 8192 <= dropped <= alone.nbytes
    assert alone[alone.numel() // 2].item() == 0.0 and alone.sum().item() < 7.0 * 2048
    assert torch.all(viewed == 5.0) and torch.all(kept_view == 5.0)
    assert torch.all(stored == 3.0) and kept_storage.nbytes() == stored.nbytes


def test_release_returns_what_a_commit_replaced_and_the_live_layers_stay():
    """A host table's release hands back the staged rows and the replaced allocations (their
    pages before the free), and the live layers compute as before."""
    from types import SimpleNamespace

    h, inter = 512, 256  # 1 MB a slot: whole pages to return

    class Reader(FakeReader):
        def __init__(self) -> None:
            super().__init__()
            self.config.hidden_size, self.config.moe_intermediate_size = h, inter

        def expert_weights(self, layer: int, e: int) -> SimpleNamespace:
            v = float(100 * layer + e)
            return SimpleNamespace(w13=torch.full((2 * inter, h), v), w2=torch.full((h, inter), v))

    t = SlotTable(Reader(), torch.float32, torch.device("cpu"), 4, staging_bytes=16 << 20, spare_bytes=0)  # type: ignore[arg-type]
    t.preload([0, 1])
    t.prepare(1, {0: [0, 1, 2, 3], 2: [3, 2, 1, 0]})
    t.commit(1)
    replaced = t._freed  # what the commit let go (held only there)
    before = sum(x.nbytes for x in slots_mod_host_tensors(replaced))
    assert before > 0
    dropped = t.release()
    assert 0 < dropped <= before
    assert values(t, 0) == [0.0, 1.0, 2.0, 3.0] and values(t, 2) == [203.0, 202.0, 201.0, 200.0]


def slots_mod_host_tensors(freed: list[object]) -> list[torch.Tensor]:
    from expertmesh.worker.slots import _host_tensors

    return list({id(x): x for x in _host_tensors(freed)}.values())


def test_release_of_the_cuda_reserve_waits_for_a_graph_capture(monkeypatch):
    """An expert server captures CUDA graphs on its compute thread and hands freed memory back
    on its loader thread; the allocator's reserve is never freed inside a capture."""
    import contextlib
    import time

    from expertmesh.worker import memory

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    captured = threading.Event()

    def capture() -> None:
        with memory.capturing():
            captured.set()
            time.sleep(0.2)
            events.append("capture done")

    t = threading.Thread(target=capture)
    t.start()
    captured.wait(5)
    memory.release(torch.device("cuda", 0))
    t.join(5)
    assert events == ["capture done", "empty_cache"]
