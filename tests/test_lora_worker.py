"""The worker core with MoE-LoRA adapters (no processes): an adapter pushed over the wire codec
for the experts this server holds is applied per token, in the server's slot order, only to the
tokens that name it; layers it does not touch compute the base; unloading makes its slot
invalid again."""

from __future__ import annotations

import pytest
import torch

from expertmesh import errors
from expertmesh.experts import TorchExpertBackend, torch_moe
from expertmesh.lora import ExpertLoRA, MoELoRAWeights, moe_lora_reference
from expertmesh.lora.store import LayerAdapter
from expertmesh.lora.wire import decode_adapter, encode_adapter
from expertmesh.worker.core import ExpertWorker, WorkerIdentity
from expertmesh.worker.slots import SlotTable
from expertmesh.worker_api import ExpertRequest
from tests.test_slots import INTER, FakeReader, H


@pytest.fixture
def worker() -> ExpertWorker:
    slots = SlotTable(FakeReader(), torch.float32, torch.device("cpu"), 4)  # type: ignore[arg-type]
    w = ExpertWorker(slots, TorchExpertBackend(), WorkerIdentity("cpu", "cpu", "host"), max_loras=2)
    w.prepare(1, {0: [3, 1], 2: [3, 1]})  # this server holds experts 3 and 1, in that slot order
    w.commit(1)
    return w


def test_pushed_adapter_applies_to_its_tokens_in_slot_order(worker):
    g = torch.Generator().manual_seed(0)
    # the coordinator sends the LoRA of experts (1, 3) of layer 2 (sorted), rank 3 / 2
    lora = ExpertLoRA(
        torch.randn(2, 3, H, generator=g),
        torch.randn(2, 2 * INTER, 3, generator=g),
        torch.randn(2, 2, INTER, generator=g),
        torch.randn(2, H, 2, generator=g),
    )
    msg = encode_adapter({2: LayerAdapter((1, 3), lora)}, torch.float32)
    worker.load_adapter(5, "a", decode_adapter(msg, H, INTER, 4, [0, 2], torch.float32))
    hidden = torch.randn(3, H, generator=g) / 100  # FakeReader's weights are 100*l + e
    slot_ids = torch.tensor([[0, 1], [1, -1], [0, -1]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=g)
    adapters = torch.tensor([5, 5, -1], dtype=torch.int32)
    req = ExpertRequest(1, 1, 2, hidden, slot_ids, weights, adapters)
    out = worker.compute(worker.check(req))
    live = worker.slots.live.layers[2]
    # slot 0 holds expert 3 (row 1 of the copy), slot 1 expert 1 (row 0)
    stacked = MoELoRAWeights.stack([lora.select([1, 0])])
    ref = moe_lora_reference(hidden, live.w13, live.w2, slot_ids, weights, stacked, torch.tensor([0, 0, -1]))
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    base = torch_moe(hidden, live.w13, live.w2, slot_ids, weights)
    assert torch.equal(out[2], base[2])  # the base token is untouched
    assert (out[:2] - base[:2]).abs().max() > 1e-3  # and the adapter tokens are not
    # layer 0: the adapter has nothing there, so its tokens compute the base
    live0 = worker.slots.live.layers[0]
    out0 = worker.compute(worker.check(ExpertRequest(2, 1, 0, hidden, slot_ids, weights, adapters)))
    assert torch.equal(out0, torch_moe(hidden, live0.w13, live0.w2, slot_ids, weights))
    assert worker.unload_adapter("a") and not worker.unload_adapter("a")
    with pytest.raises(errors.InvalidRequest, match=r"\[5\] hold no adapter"):
        worker.check(req)
