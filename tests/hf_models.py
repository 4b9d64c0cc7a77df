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
    """Saves a random HF model of ``model_type`` to ``out``; returns the HF model (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**BASE, **CONFIGS[model_type]}, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # random init is ~N(0, 0.02): scale it up so routing and logits are far from ties
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() >= 2 else 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, save_original_format=original_format, **kw)
    return model
