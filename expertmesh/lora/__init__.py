"""MoE LoRA shared by the coordinator and both expert servers: the maths and batched reference
(:mod:`expertmesh.lora.moe`), and an expert server's adapter store (:mod:`expertmesh.lora.store`)."""

from __future__ import annotations

from expertmesh.lora.moe import ExpertLoRA, LoRABatch, MoELoRAWeights, lora_delta, moe_lora_reference

__all__ = ["ExpertLoRA", "LoRABatch", "MoELoRAWeights", "lora_delta", "moe_lora_reference"]
