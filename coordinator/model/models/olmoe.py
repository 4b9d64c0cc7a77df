"""OLMoE: GQA with RMSNorm over the whole q and k projections, optional qkv clipping."""

from __future__ import annotations

import torch

from coordinator.model.models.attention import Attention
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import MoEBlock
from expertmesh.config import ModelConfig


def build(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.qk_norm == "full", cfg.qk_norm
    return CausalLM(cfg, dtype, Attention, MoEBlock)
