"""The GPU expert backend: fused Triton MoE kernels behind the ExpertBackend interface."""

from __future__ import annotations

import torch

from expertmesh.experts import ExpertBackend, TorchExpertBackend
from gpu_server.kernels import ConfigTable, fused_moe, table_for_gpu
from gpu_server.kernels.moe_lora import fused_moe_lora


class TritonExpertBackend(ExpertBackend):
    """Fused MoE in Triton, with launch configs tuned for the GPU it runs on (see kernels/tune.py)."""

    name = "triton"

    def __init__(self, table: ConfigTable | None = None):
        self.table = table if table is not None else ConfigTable.empty()

    @classmethod
    def for_device(cls, device: str | torch.device) -> TritonExpertBackend:
        return cls(table_for_gpu(torch.cuda.get_device_name(torch.device(device))))

    def forward(self, x, w13, w2, slot_ids, weights, lora=None):
        cfg = self.table.lookup(x.shape[1], w2.shape[2], x.shape[0], slot_ids.shape[1], w13.shape[0])
        if lora is not None:  # MoE LoRA: gpu_server/kernels/moe_lora.py
            return fused_moe_lora(x, w13, w2, slot_ids, weights, lora.weights, lora.token_adapter, config=cfg)
        return fused_moe(x, w13, w2, slot_ids, weights, config=cfg)


def make_backend(device: str) -> ExpertBackend:
    """The Triton backend on a CUDA device, the plain torch backend anywhere else."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return TritonExpertBackend.for_device(device)
    return TorchExpertBackend()
