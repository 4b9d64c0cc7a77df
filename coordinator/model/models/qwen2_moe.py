"""Qwen2-MoE: GQA with q/k/v bias, softmax top-k, a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

import torch

from coordinator.model.models.attention import Attention
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import MoEBlock
from expertmesh.config import ModelConfig


def build(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.shared_expert_gate, "Qwen2-MoE's shared expert is gated"
    return CausalLM(cfg, dtype, Attention, lambda c, i, d: MoEBlock(c, i, d, shared_name="shared_expert"))
