"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

Keys and values come out of a low-rank latent: ``kv_a_proj_with_mqa`` compresses the hidden
state into a latent (``kv_lora_rank``) plus one rotary key part shared by all heads;
``kv_b_proj`` expands the normalised latent into per-head non-rotary keys and values. Queries
come from ``q_proj``, or from their own latent (``q_a_proj`` -> norm -> ``q_b_proj``) when
``q_lora_rank`` is set; only the last ``qk_rope_head_dim`` dims of queries and keys are rotated.

The cache holds the decompressed per-head K ``[Hq, Dn+Dr]`` and V ``[Hq, Dv]`` (what
``ModelConfig.kv_heads_cached`` / ``q_head_dim`` / ``v_dim`` describe), so attention itself is
plain MHA. Caching the latent instead would cut the cache ~30x; the maths would not change.

Shapes: T tokens in the step, H hidden, Hq heads, Dn/Dr non-rotary/rotary query-key dims,
Dv value dim, Rq/Rkv query/KV latent ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from coordinator.batch import ForwardBatch
from coordinator.models import rope
from coordinator.models.attention import paged_attention
from coordinator.models.layers import MergedLinear, RMSNorm, Rotary, linear
from expertmesh.config import ModelConfig

# NOTE: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not
# config.rms_norm_eps (the checkpoints were trained that way too).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DeepSeek MLA. ``rope_in_float32``: rotate in float32 and round once (DeepSeek-V2, whose
    HF code rotates as complex float32 numbers) rather than in the activation dtype (V3)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, dtype: torch.dtype, rope_in_float32: bool = False
    ) -> None:
        super().__init__()
        assert cfg.attention == "mla", cfg.attention
        self.layer = layer
        self.h = cfg.num_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        hidden, q_out = cfg.hidden_size, self.h * (self.dn + self.dr)
        self.q_lora = cfg.q_lora_rank is not None
        if cfg.q_lora_rank is not None:
            # q_a and kv_a read the same input: one GEMM
            parts = {"q_a_proj": cfg.q_lora_rank, "kv_a_proj_with_mqa": self.kv_rank + self.dr}
            self.qkv_a_proj = MergedLinear(hidden, parts, False, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, q_out, dtype)
        else:
            self.q_proj = linear(hidden, q_out, dtype)
            self.kv_a_proj_with_mqa = linear(hidden, self.kv_rank + self.dr, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(self.kv_rank, self.h * (self.dn + self.dv), dtype)
        self.o_proj = linear(self.h * self.dv, hidden, dtype)
        self.rotary = Rotary(
            self.dr, cfg.rope_theta, interleave=cfg.rope_interleave, scaling=cfg.rope_scaling
        )
        self.rope_in_float32 = rope_in_float32
        # DeepSeek's YaRN correction: the softmax scale times mscale(factor, mscale_all_dim)^2
        self.scale = cfg.q_head_dim**-0.5 * rope.softmax_scale_factor(cfg.rope_scaling)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q_latent, kv_a = self.qkv_a_proj(x)  # [T, Rq], [T, Rkv+Dr]
            q = self.q_b_proj(self.q_a_layernorm(q_latent))  # [T, Hq*(Dn+Dr)]
        else:
            q = self.q_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)  # [T, Rkv+Dr]
        q_nope, q_rope = q.view(t, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        kv_latent, k_rope = kv_a.split([self.kv_rank, self.dr], dim=-1)  # [T, Rkv], [T, Dr]
        kv_full = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(t, self.h, self.dn + self.dv)
        k_nope, v = kv_full.split([self.dn, self.dv], dim=-1)  # [T, Hq, Dn], [T, Hq, Dv]
        q_rope, k_rope = self._rotate(q_rope, k_rope[:, None, :], batch.positions)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, Hq, Dn+Dr]
        k = torch.cat([k_nope, k_rope.expand(t, self.h, self.dr)], dim=-1)  # [T, Hq, Dn+Dr]
        o = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)  # [T, Hq, Dv]
        return self.o_proj(o.reshape(t, self.h * self.dv))

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, Dr], k [T, 1, Dr]. Interleaved pairs come out de-interleaved (halves) for
        q and k alike, so their dot products are those of the model."""
        dtype = torch.float32 if self.rope_in_float32 else q.dtype
        cos, sin = self.rotary.cos_sin(positions, dtype)  # [T, Dr]
        q_out = self.rotary.apply(q.to(dtype), cos, sin).to(q.dtype)
        k_out = self.rotary.apply(k.to(dtype), cos, sin).to(k.dtype)
        return q_out, k_out
