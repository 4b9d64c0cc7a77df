"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k routing, no shared expert."""

from __future__ import annotations

import torch

from coordinator.model.models.attention import Attention
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import MoEBlock
from expertmesh.config import ModelConfig


def build(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.qk_norm == "head" and cfg.shared_expert_intermediate_size == 0, cfg
    return CausalLM(cfg, dtype, Attention, MoEBlock)
