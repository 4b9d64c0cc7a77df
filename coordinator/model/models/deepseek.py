"""DeepSeek-V2 and DeepSeek-V3: MLA attention, shared experts, dense first layers.

The two differ in routing (V2: softmax, greedy or group-limited greedy; V3: sigmoid with a
correction bias, noaux_tc group-limited top-k, renormalised) and in how HF rotates the rope
dims (V2: complex float32 on adjacent pairs; V3: in the activation dtype, pairs or halves per
``rope_interleave``). Both compute the router logits in float32 and keep the routing weights
in float32; the first ``first_k_dense_replace`` layers use a dense ``GatedMLP``.

Shapes: T tokens, H hidden, E experts.
"""

from __future__ import annotations

import torch

from coordinator.model.models.base import CausalLM
from coordinator.model.models.mla import MLAttention
from coordinator.model.models.moe import MoEBlock
from expertmesh.config import ModelConfig


def deepseek_moe(cfg: ModelConfig, layer: int, dtype: torch.dtype) -> MoEBlock:
    """Shared experts named ``shared_experts``; the gate matmul in float32, as DeepSeek's router does."""
    block = MoEBlock(cfg, layer, dtype, shared_name="shared_experts", logits_fp32=True)
    assert not block.spec.round_weights, "DeepSeek keeps its routing weights in float32"
    return block


def build_v2(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.scoring == "softmax" and cfg.topk_method != "noaux_tc", cfg
    assert cfg.shared_expert_intermediate_size > 0, "DeepSeek MoE layers have shared experts"
    return CausalLM(cfg, dtype, lambda c, i, d: MLAttention(c, i, d, rope_in_float32=True), deepseek_moe)


def build_v3(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.scoring == "sigmoid" and cfg.topk_method == "noaux_tc" and cfg.correction_bias, cfg
    assert cfg.shared_expert_intermediate_size > 0, "DeepSeek MoE layers have shared experts"
    return CausalLM(cfg, dtype, MLAttention, deepseek_moe)
