"""Piecewise decode graphs of a CUDA coordinator with its experts on a GPU expert server
(coordinator/model/remote_graphs.py): the graphed steps give the logits of the eager steps and of the
in-process engine, at batch sizes that fill a bucket and that pad one, over each data path; the
load hook sees every layer's routing."""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.model.engine import Engine
from coordinator.model.remote_graphs import RemoteDecodeGraphs
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import engine_for
from tests.test_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def decode(eng: Engine, batch: int, steps: int) -> torch.Tensor:  # [steps, batch, V]
    g = torch.Generator().manual_seed(batch)
    seqs = [eng.new_seq() for _ in range(batch)]
    prompts = [torch.randint(0, 96, (3 + i,), generator=g).tolist() for i in range(batch)]
    out = [torch.stack(eng.step(list(zip(seqs, prompts))))]
    for _ in range(steps - 1):
        toks = out[-1].argmax(-1).tolist()
        out.append(torch.stack(eng.step([(s, [t]) for s, t in zip(seqs, toks)])))
    for s in seqs:
        eng.free(s)
    return torch.stack(out).cpu()


def test_piecewise_graphs_match_eager_and_in_process(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    srv = start_server("gpu", tmp_path, 0, "--device", "cuda", timeout=300)
    servers = (ServerSpec("gpu0", srv.address, "gpu"),)
    ref = Engine.from_checkpoint(str(tmp_path), device="cuda", num_pages=64, page_size=4)
    seen: list[tuple[int, int]] = []  # (layer, rows) per load-hook call
    try:
        for transport in ["grpc", "auto"]:
            eng, d = engine_for(tmp_path, ClusterConfig(servers, transport=transport, timeout_s=120), "cuda")
            assert isinstance(eng.graphs, RemoteDecodeGraphs)
            seen.clear()
            eng.graphs.load_hook = lambda layer, ids: seen.append((layer, ids.shape[0]))
            try:
                for batch in (1, 3):  # 3 pads the bucket of 4
                    graphed = decode(eng, batch, 5)
                    layers = [blk.layer for blk in eng.model.moe_blocks()]
                    assert sorted(seen) == sorted((layer, batch) for layer in layers for _ in range(4)), seen
                    seen.clear()
                    eng.graphs, graphs = None, eng.graphs
                    eager = decode(eng, batch, 5)
                    eng.graphs = graphs
                    assert rel_err(graphed, eager) < 1e-5, (transport, batch)
                    assert rel_err(graphed, decode(ref, batch, 5)) < 1e-4, (transport, batch)
            finally:
                d.close()
    finally:
        srv.stop()


def test_server_graphs_match_the_kernels_and_plain_torch():
    from expertmesh.experts import torch_moe
    from gpu_server.backend import make_backend
    from gpu_server.graphs import GraphedBackend

    inner = make_backend("cuda")
    graphed = GraphedBackend(inner, buckets=(1, 4, 8))
    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, i, k = 6, 64, 32, 2
    w13 = torch.randn(s, 2 * i, h, device="cuda", generator=g) / h**0.5
    w2 = torch.randn(s, h, i, device="cuda", generator=g) / i**0.5
    for t in (3, 1, 8, 2, 9, 3):  # a smaller request after a larger one in the same bucket: re-padded
        x = torch.randn(t, h, device="cuda", generator=g)
        ids = torch.randint(-1, s, (t, k), device="cuda", generator=g, dtype=torch.int32)
        w = torch.rand(t, k, device="cuda", generator=g)
        got = graphed.forward(x, w13, w2, ids, w)
        assert got.shape == (t, h)
        # the same kernels at the bucket's size (padding rows: slot -1) compute the same rows
        b = next((b for b in (1, 4, 8) if b >= t), t)
        pad = b - t
        xp = torch.cat([x, torch.randn(pad, h, device="cuda", generator=g)])
        idp = torch.cat([ids, torch.full((pad, k), -1, dtype=torch.int32, device="cuda")])
        wp = torch.cat([w, torch.rand(pad, k, device="cuda", generator=g)])
        assert rel_err(got, inner.forward(xp, w13, w2, idp, wp)[:t]) < 1e-6, t
        assert rel_err(got, torch_moe(x, w13, w2, ids, w)) < 2e-3, t
    assert len(graphed._graphs) == 3  # buckets 1, 4, 8 (9 tokens ran eagerly)


def test_server_graphs_write_straight_into_the_ring():
    """GraphedBackend.forward_into (the fast paths): routing from host tensors (uploaded by
    the graph), hidden on the GPU or in pinned host memory, answer into a GPU or host buffer;
    equal to the same kernels at the bucket's size, across re-padding and staging reuse."""
    import numpy as np

    from gpu_server.backend import make_backend
    from gpu_server.graphs import GraphedBackend

    inner = make_backend("cuda")
    graphed = GraphedBackend(inner, buckets=(1, 4, 8))
    g = torch.Generator(device="cuda").manual_seed(1)
    s, h, i, k = 6, 64, 32, 2
    w13 = torch.randn(s, 2 * i, h, device="cuda", generator=g) / h**0.5
    w2 = torch.randn(s, h, i, device="cuda", generator=g) / i**0.5
    w13b, w2b = w13.flip(0).contiguous(), w2.flip(0).contiguous()  # another layer, same bucket
    for n, t in enumerate((3, 1, 4, 2, 8, 3, 9)):
        x = torch.randn(t, h, device="cuda", generator=g)
        ids = torch.randint(-1, s, (t, k), device="cuda", generator=g, dtype=torch.int32)
        w = torch.rand(t, k, device="cuda", generator=g)
        a13, a2 = (w13, w2) if n % 2 else (w13b, w2b)
        want = inner.forward(x, a13, a2, ids, w)
        on_host = n % 3 == 2
        xin = x.cpu().pin_memory() if on_host else x
        out = torch.full((t, h), float("nan"), device="cpu" if on_host else "cuda")
        done = graphed.forward_into(xin, a13, a2, ids.cpu(), w.cpu(), out)
        assert done == (t <= 8), t
        if done:
            torch.cuda.synchronize()
            assert rel_err(out.cuda(), want) < 1e-6, (n, t)
    # the gRPC path's forward (routing handed over on the GPU) still agrees after all that
    x = torch.randn(2, h, device="cuda", generator=g)
    ids = torch.tensor([[0, -1], [5, 2]], dtype=torch.int32, device="cuda")
    w = torch.rand(2, k, device="cuda", generator=g)
    assert rel_err(graphed.forward(x, w13, w2, ids, w), inner.forward(x, w13, w2, ids, w)) < 1e-6
    assert np.isfinite(graphed._staging[(4, k)].np[1].view(np.float32)).all()
