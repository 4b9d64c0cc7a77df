"""The remote wait of one MoE layer (coordinator/experts/remote.py ``_waiter``): the GPU servers'
answers are collected before the CPU servers' (sends go CPU first) and each is summed into its
rows as it comes; every collected answer's ring space is given back."""

from __future__ import annotations

import torch

from coordinator.experts.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from expertmesh import placement as pl
from expertmesh.config import ModelConfig

RAW = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=4, moe_intermediate_size=4, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64,
)  # fmt: skip


class FakeReply:
    def __init__(self, name: str, part: torch.Tensor, log: list[str]) -> None:
        self.name, self.part, self.log = name, part, log

    def result(self, timeout: float) -> torch.Tensor:
        self.log.append(f"result {self.name}")
        return self.part

    def release(self) -> None:
        self.log.append(f"release {self.name}")

    def abandon(self) -> None:
        self.log.append(f"abandon {self.name}")


def test_gpu_answers_are_collected_first_and_every_answer_is_summed_once():
    cfg = ModelConfig.from_dict(RAW)
    servers = (ServerSpec("c", "127.0.0.1:1", "cpu"), ServerSpec("g", "127.0.0.1:2", "gpu"))
    d = RemoteDispatcher(cfg, ClusterConfig(servers, num_gpu_experts=2), torch.float32)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 8, generator=g)  # [T, H]
        cpu_rows, gpu_rows = torch.tensor([0, 2]), torch.tensor([0, 1, 2])
        cpu_part, gpu_part = torch.randn(2, 8, generator=g), torch.randn(3, 8, generator=g)
        log: list[str] = []
        sent = [  # as submit sends them: the CPU server first
            (pl.ServerBatch(0, cpu_rows, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)), FakeReply("cpu", cpu_part, log)),
            (pl.ServerBatch(1, gpu_rows, torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)), FakeReply("gpu", gpu_part, log)),
        ]  # fmt: skip
        tables = d.expert_cluster.tables
        ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
        out = torch.full((3, 8), float("nan"))  # where the sum goes (a graph's static buffer)
        wait, _ = d._waiter(tables, 0, x, ids, w, None, None, sent, 0.0, None, out)
        got = wait()
        assert got is out
        want = gpu_part.clone()
        want.index_add_(0, cpu_rows, cpu_part)
        assert torch.equal(got, want)
        assert log == ["result gpu", "release gpu", "result cpu", "release cpu"]
        # one CPU answer that covers only some rows: the others are zeros, not stale buffer data
        log.clear()
        out.fill_(float("nan"))
        wait, _ = d._waiter(tables, 0, x, ids, w, None, None, sent[:1], 0.0, None, out)
        want = torch.zeros(3, 8).index_add_(0, cpu_rows, cpu_part)
        assert torch.equal(wait(), want)
    finally:
        d.close()
