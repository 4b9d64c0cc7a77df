"""An expert server's adapter store: LRU residency in fixed buffers, reload from host copies,
slot tables that change under it, and the errors a bad request gets."""

from __future__ import annotations

import pytest
import torch

from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference
from expertmesh.lora.store import AdapterStore, AdapterStoreError, LayerAdapter

H, INTER, E = 32, 24, 8


def rand_lora(n: int, r13: int, r2: int, seed: int) -> ExpertLoRA:
    g = torch.Generator().manual_seed(seed)
    return ExpertLoRA(
        torch.randn(n, r13, H, generator=g),
        torch.randn(n, 2 * INTER, r13, generator=g),
        torch.randn(n, r2, INTER, generator=g),
        torch.randn(n, H, r2, generator=g),
    )


@pytest.fixture
def adapters():
    # id -> full-expert LoRA of layer 1 (different ranks), and which experts each server copy has
    return {10: rand_lora(E, 4, 2, 1), 11: rand_lora(E, 8, 4, 2), 12: rand_lora(E, 6, 6, 3)}


def direct(x, w13, w2, ids, wts, experts, loras, token_ids):
    """Reference: the adapters' rows for ``experts`` stacked directly, no store."""
    order = sorted(loras)
    stacked = MoELoRAWeights.stack([loras[i].select(list(experts)) for i in order])
    idx = torch.tensor([order.index(int(t)) if t >= 0 else -1 for t in token_ids])
    return moe_lora_reference(x, w13, w2, ids, wts, stacked, idx)


def via_store(store, x, w13, w2, ids, wts, experts, token_ids):
    index = store.buffer_index(token_ids)
    return moe_lora_reference(x, w13, w2, ids, wts, store.weights(1, experts), index)


def test_lru_reload_and_slot_table_change(adapters):
    store = AdapterStore(max_loras=2, dtype=torch.float64, device=torch.device("cpu"))
    for i, lo in adapters.items():
        store.add(i, f"a{i}", {1: LayerAdapter(tuple(range(E)), lo)})
    g = torch.Generator().manual_seed(0)
    experts = (5, 2, 7)
    s = len(experts)
    x = torch.randn(6, H, generator=g, dtype=torch.float64)
    w13 = torch.randn(s, 2 * INTER, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(s, H, INTER, generator=g, dtype=torch.float64)
    ids = torch.randint(-1, s, (6, 2), generator=g)
    wts = torch.rand(6, 2, generator=g, dtype=torch.float64)
    loras = {
        i: ExpertLoRA(*(t.double() for t in (lo.a13, lo.b13, lo.a2, lo.b2))) for i, lo in adapters.items()
    }

    tok = torch.tensor([10, 11, -1, 10, 11, 11])
    first = via_store(store, x, w13, w2, ids, wts, experts, tok)
    assert torch.allclose(first, direct(x, w13, w2, ids, wts, experts, loras, tok))
    # 12 needs a buffer: 10 was used least recently (11 came after it in the batch)
    tok12 = torch.tensor([12, 12, -1, 12, -1, 12])
    got = via_store(store, x, w13, w2, ids, wts, experts, tok12)
    assert torch.allclose(got, direct(x, w13, w2, ids, wts, experts, loras, tok12))
    assert set(store.resolve(torch.tensor([11, 12]))) == {11, 12}
    # 10 comes back from its host copy and computes exactly as before
    assert torch.equal(via_store(store, x, w13, w2, ids, wts, experts, tok), first)
    # a placement change: the buffers follow the new slot table
    new = (2, 3, 0)
    assert torch.allclose(
        via_store(store, x, w13, w2, ids, wts, new, tok), direct(x, w13, w2, ids, wts, new, loras, tok)
    )


def test_partial_copies_and_errors(adapters):
    store = AdapterStore(max_loras=2, dtype=torch.float32, device=torch.device("cpu"))
    # this server was sent experts 2 and 5 only; the others read as zero
    store.add(10, "a", {1: LayerAdapter((2, 5), adapters[10].select([2, 5]))})
    store.buffer_index(torch.tensor([10]))
    w = store.weights(1, (5, 3, 2))
    assert torch.equal(w.a13[0, 0, :4], adapters[10].a13[5])
    assert torch.equal(w.a13[0, 2, :4], adapters[10].a13[2])
    assert not w.a13[0, 1].any() and not w.b2[0, 1].any()
    assert store.weights(0, (5, 3, 2)) is None  # no adapter touches layer 0
    with pytest.raises(AdapterStoreError, match=r"\[99\] not loaded"):
        store.buffer_index(torch.tensor([10, 99]))
    store.add(11, "b", {1: LayerAdapter((2,), adapters[11].select([2]))})
    store.add(12, "c", {1: LayerAdapter((2,), adapters[12].select([2]))})
    with pytest.raises(AdapterStoreError, match="3 adapters in one request"):
        store.buffer_index(torch.tensor([10, 11, 12]))
    assert store.remove(11) and not store.remove(11)
    assert store.names() == {10: "a", 12: "c"}


def test_wire_round_trip_and_refusals(adapters):
    from expertmesh.lora.wire import decode_adapter, encode_adapter

    sent = {1: LayerAdapter((2, 5), adapters[11].select([2, 5]))}
    msg = encode_adapter(sent, torch.float32)
    got = decode_adapter(msg, H, INTER, E, [1, 2], torch.float32)
    assert got[1].experts == (2, 5)
    for part in ("a13", "b13", "a2", "b2"):
        assert torch.equal(getattr(got[1].lora, part), getattr(sent[1].lora, part))
    with pytest.raises(ValueError, match="layer 1 is not an MoE layer"):
        decode_adapter(msg, H, INTER, E, [0, 2], torch.float32)
    with pytest.raises(ValueError, match=r"layer 1 b13: .*expected float \[2, 48, 8\]"):
        decode_adapter({**msg, "1.b13": msg["1.b2"]}, H, INTER, E, [1], torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        decode_adapter(msg, H, INTER, 4, [1], torch.float32)
