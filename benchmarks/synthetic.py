"""Synthetic one-layer Qwen3-MoE checkpoints of real layer widths, for benchmarks only
(random weights; written with safetensors, no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_moe_layer(
    out: Path, hidden: int, inter: int, experts: int, top_k: int, dtype=torch.float32
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="qwen3_moe",
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": (
            torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
        ).to(dtype),
        "model.layers.0.mlp.experts.down_proj": (
            torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
        ).to(dtype),
    }
    save_file(tensors, str(out / "model.safetensors"))
    return out
