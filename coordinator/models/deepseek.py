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
import torch.nn.functional as F

from coordinator.models.base import CausalLM
from coordinator.models.mla import MLAttention
from coordinator.models.moe import MoEBlock
from coordinator.router import route
from expertmesh.config import ModelConfig


class DeepseekMoE(MoEBlock):
    """MoEBlock with the gate matmul in float32, as DeepSeek's router does it.

    NOTE: this repeats MoEBlock.forward save for the first line; a float32-logits switch in
    MoEBlock would let it go.
    """

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer, dtype, shared_name="shared_experts")
        assert not self.spec.round_weights, "DeepSeek keeps its routing weights in float32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        assert self.dispatcher is not None, "MoEBlock used before a dispatcher was attached"
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E] float32
        topk_ids, topk_weights = route(logits, self.spec, self.gate.e_score_correction_bias)
        if self.load_hook is not None:
            self.load_hook(self.layer, topk_ids)
        pending = self.dispatcher.submit(self.layer, x, topk_ids, topk_weights)
        shared_out = getattr(self, self.shared_name)(x)  # overlaps with the routed experts
        return pending.wait() + shared_out


def build_v2(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.scoring == "softmax" and cfg.topk_method != "noaux_tc", cfg
    assert cfg.shared_expert_intermediate_size > 0, "DeepSeek MoE layers have shared experts"
    return CausalLM(cfg, dtype, lambda c, i, d: MLAttention(c, i, d, rope_in_float32=True), DeepseekMoE)


def build_v3(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    assert cfg.scoring == "sigmoid" and cfg.topk_method == "noaux_tc" and cfg.correction_bias, cfg
    assert cfg.shared_expert_intermediate_size > 0, "DeepSeek MoE layers have shared experts"
    return CausalLM(cfg, dtype, MLAttention, DeepseekMoE)
