"""Tiny random HF checkpoints made at test time (transformers is the reference, never runtime).

Each architecture gets a config small enough to build in well under a second, with every
feature the parity tests must cover switched on (shared experts, dense layers, groups, bias).
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "qwen2_moe": dict(
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        clip_qkv=8.0,
        eos_token_id=1,
        pad_token_id=0,
    ),
    # MLA without a query latent, dense layer 0, softmax greedy routing scaled by 2
    "deepseek_v2": dict(
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
    ),
    # the same with DeepSeek-V2's group-limited routing (4 groups of 2, keep 2)
    "deepseek_v2_grouped": dict(
        model_type="deepseek_v2",
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
    ),
    # MLA with a query latent, interleaved rope, dense layer 0, sigmoid + correction bias
    # (randomised in make_checkpoint), noaux_tc over 2 groups keeping 1, renormalised, x2.5
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=40,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}

ARCHS = list(CONFIGS)


def make_checkpoint(
    model_type: str,
    out: Path,
    original_format: bool = True,
    seed: int = 0,
    max_shard_size: str | None = None,
    tie: bool = False,
):
    """Saves a random HF model of ``model_type`` to ``out``; returns the HF model (float32).

    ``model_type`` is a key of CONFIGS: the HF model_type, or a variant of one that names its
    HF model_type in its fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {**BASE, **CONFIGS[model_type]}
    hf_type = fields.pop("model_type", model_type)
    cfg = AutoConfig.for_model(hf_type, **fields, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # random init is ~N(0, 0.02): scale it up so routing and logits are far from ties
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() >= 2 else 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
        # HF starts DeepSeek-V3's correction bias at zero; a nonzero one makes ignoring it fail
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, save_original_format=original_format, **kw)
    return model
