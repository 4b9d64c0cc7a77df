"""The GPU expert backend: fused Triton MoE kernels behind the ExpertBackend interface."""

from __future__ import annotations

import torch

from expertmesh.experts import ExpertBackend, TorchExpertBackend
from gpu_server.kernels import ConfigTable, fused_moe, table_for_gpu


class TritonExpertBackend(ExpertBackend):
    """Fused MoE in Triton, with launch configs tuned for the GPU it runs on (see kernels/tune.py)."""

    name = "triton"

    def __init__(self, table: ConfigTable | None = None):
        self.table = table if table is not None else ConfigTable.empty()

    @classmethod
    def for_device(cls, device: str | torch.device) -> TritonExpertBackend:
        return cls(table_for_gpu(torch.cuda.get_device_name(torch.device(device))))

    def forward(self, x, w13, w2, slot_ids, weights):
        cfg = self.table.lookup(x.shape[1], w2.shape[2], x.shape[0], slot_ids.shape[1], w13.shape[0])
        return fused_moe(x, w13, w2, slot_ids, weights, config=cfg)


def make_backend(device: str) -> ExpertBackend:
    """The Triton backend on a CUDA device, the plain torch backend anywhere else."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return TritonExpertBackend.for_device(device)
    return TorchExpertBackend()
