"""Mixtral: GQA, softmax over the top-k router logits (= renormalised top-k), no shared expert.

Checkpoints name the block ``block_sparse_moe`` with ``w1/w3/w2`` experts; the loader maps
``block_sparse_moe.gate`` onto ``mlp.gate``.
"""

from __future__ import annotations

import torch

from coordinator.model.models.attention import Attention
from coordinator.model.models.base import CausalLM
from coordinator.model.models.moe import MoEBlock
from expertmesh.config import ModelConfig


def build(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.norm_topk_prob, "Mixtral renormalises its top-k weights"
    return CausalLM(cfg, dtype, Attention, MoEBlock)
