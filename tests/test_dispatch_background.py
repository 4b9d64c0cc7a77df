"""LocalDispatcher's background load (the coordinator on CUDA reads its experts while the engine
compiles its kernels): calls wait for the experts unless marked early, a failed read fails the
wait, and what it computes equals a dispatcher that loaded first."""

from __future__ import annotations

import threading

import pytest
import torch

from coordinator.model.dispatch import LocalDispatcher
from expertmesh.checkpoint import CheckpointReader
from tests.hf_models import make_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", path)
    return str(path)


def _call(reader: CheckpointReader):
    cfg = reader.config
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.hidden_size, generator=g)  # [T, H]
    ids = torch.randint(0, cfg.num_experts, (5, 2), generator=g)  # [T, K]
    w = torch.rand(5, 2, generator=g)  # [T, K]
    return cfg.moe_layer_ids[-1], x, ids, w


def test_calls_wait_for_the_experts_except_early_ones(ckpt, monkeypatch):
    reader = CheckpointReader(ckpt)
    layer, x, ids, w = _call(reader)
    want = LocalDispatcher(reader, torch.float32, CPU).submit(layer, x, ids, w).wait()
    gate, real = threading.Event(), reader.expert_into

    def slow(*a, **kw):
        assert gate.wait(30), "the test never opened the gate"
        return real(*a, **kw)

    monkeypatch.setattr(reader, "expert_into", slow)
    disp = LocalDispatcher(reader, torch.float32, CPU, background=True)
    assert disp.load is not None  # returned before any expert was read
    with disp.load.early():  # a compile warm-up: runs now, on the zeroed slots
        assert not disp.submit(layer, x, ids, w).wait().any()
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.append(disp.submit(layer, x, ids, w).wait()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got, "a call ran before the experts were read"
    gate.set()
    t.join(30)
    assert got and torch.equal(got[0], want)
    assert disp.load is None  # waited once; later calls go straight through
    assert torch.equal(disp.submit(layer, x, ids, w).wait(), want)


def test_a_failed_read_fails_the_wait_and_the_calls(ckpt, monkeypatch):
    reader = CheckpointReader(ckpt)
    layer, x, ids, w = _call(reader)

    def broken(*a, **kw):
        raise OSError("the disk went away")

    monkeypatch.setattr(reader, "expert_into", broken)
    disp = LocalDispatcher(reader, torch.float32, CPU, background=True)
    with pytest.raises(OSError, match="disk went away"):
        disp.submit(layer, x, ids, w)
    with pytest.raises(OSError, match="disk went away"):
        LocalDispatcher(reader, torch.float32, CPU, background=True).wait_loaded()
    with pytest.raises(OSError, match="disk went away"):  # and the loader without a thread
        LocalDispatcher(reader, torch.float32, CPU)
