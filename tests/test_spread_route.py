"""The numpy route of a layer whose experts sit once each on several servers (a static split,
``--num-gpu-experts``; coordinator/experts/remote.py ``_spread_route``) gives the batches and physical
slots of the general path (replica choice + ``split_by_server``, expertmesh/placement.py)."""

from __future__ import annotations

import pytest
import torch

from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from expertmesh import placement as pl
from expertmesh.config import ModelConfig

RAW = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=32,
    num_experts_per_tok=4, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64,
)  # fmt: skip


@pytest.mark.parametrize("gpu_experts", [1, 8, 16, 31])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_spread_route_matches_split_by_server(gpu_experts, t):
    cfg = ModelConfig.from_dict(RAW)
    servers = (ServerSpec("g", "127.0.0.1:1", "gpu"), ServerSpec("c", "127.0.0.1:2", "cpu"))
    d = RemoteDispatcher(cfg, ClusterConfig(servers, num_gpu_experts=gpu_experts), torch.float32)
    try:
        tables = d.expert_cluster.tables
        d._step = tables
        d._route_around(tables, frozenset())
        assert sorted(d._spread) == [0, 1] and not d._single  # every layer is a two-server split
        g = torch.Generator().manual_seed(t * 100 + gpu_experts)
        ids = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(t)])  # [T, K]
        if t == 3:
            ids[1] = torch.arange(4)  # all on the GPU server from 4 GPU experts: the CPU batch skips row 1
        w = torch.rand(t, 4, generator=g)
        got, phys = d._route(tables, 0, ids, w)
        lt = tables.placement.tables[0]
        want_phys = pl.choose_replicas(ids, lt, "static", 0)
        want = pl.split_by_server(want_phys, w, lt, 2)
        assert torch.equal(phys, want_phys)
        assert [b.server for b in got] == [b.server for b in want]
        for a, b in zip(got, want):
            assert torch.equal(a.rows, b.rows) and a.rows.dtype == b.rows.dtype
            assert torch.equal(a.slot_ids, b.slot_ids) and a.slot_ids.dtype == torch.int32
            assert torch.equal(a.weights, b.weights) and a.weights.dtype == torch.float32
    finally:
        d.close()
