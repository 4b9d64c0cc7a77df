"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

Keys and values come out of a low-rank latent: ``kv_a_proj_with_mqa`` compresses the hidden
state into a latent (``kv_lora_rank``) plus one rotary key part shared by all heads;
``kv_b_proj`` expands the normalised latent into per-head non-rotary keys (``W_UK``) and values
(``W_UV``). Queries come from ``q_proj``, or from their own latent (``q_a_proj`` -> norm ->
``q_b_proj``) when ``q_lora_rank`` is set; only the last ``qk_rope_head_dim`` dims of queries
and keys are rotated.

The cache holds, per token, the normalised latent and the rotated key part (``Rkv + Dr``
values, coordinator/model/kv_cache.py), never the per-head K/V. Attention runs in the absorbed form:
``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so each head's non-rotary query is mapped into
the latent space once (``q_lat``), all heads attend over the cached rows as one shared KV head
(MQA: score = ``q_lat . c + q_rope . k_rope``, value = ``c``), and the per-head output is
mapped back through ``W_UV`` before ``o_proj``. Every step (decode, prefill, extend over a
cached prefix) takes this form: one kernel for mixed steps and CUDA graphs, and no prefix ever
decompressed (benchmarks/RESULTS.md has the prefill cost).

Shapes: T tokens in the step, H hidden, Hq heads, Dn/Dr non-rotary/rotary query-key dims,
Dv value dim, Rq/Rkv query/KV latent ranks, R cache rows, S cached positions of a sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.model.batch import ForwardBatch
from coordinator.model.models import rope
from coordinator.model.models.layers import MergedLinear, RMSNorm, Rotary, linear
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
        # the query's first projection and kv_a read the same input: one GEMM
        if cfg.q_lora_rank is not None:
            parts = {"q_a_proj": cfg.q_lora_rank, "kv_a_proj_with_mqa": self.kv_rank + self.dr}
            self.qkv_a_proj = MergedLinear(hidden, parts, False, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, q_out, dtype)
        else:
            parts = {"q_proj": q_out, "kv_a_proj_with_mqa": self.kv_rank + self.dr}
            self.q_kv_a_proj = MergedLinear(hidden, parts, False, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(self.kv_rank, self.h * (self.dn + self.dv), dtype)
        self.o_proj = linear(self.h * self.dv, hidden, dtype)
        self.rotary = Rotary(
            self.dr, cfg.rope_theta, interleave=cfg.rope_interleave, scaling=cfg.rope_scaling
        )
        self.rope_in_float32 = rope_in_float32
        # DeepSeek's YaRN correction: the softmax scale times mscale(factor, mscale_all_dim)^2
        self.scale = cfg.q_head_dim**-0.5 * rope.softmax_scale_factor(cfg.rope_scaling)
        self._inv_freq: torch.Tensor | None = None  # the CUDA path's rotary frequencies
        # the Triton path on any device (tests run it on the CPU under the Triton interpreter)
        self.triton_on_cpu = False
        # LoRA on kv_b_proj, set by the LoRA manager (it cannot hook a layer that never runs as
        # one): () -> None, or (token adapter slots [T], slot -> LoRA with a [r, Rkv], b [Hq*(Dn+Dv), r])
        self.kv_b_lora: Callable[[], tuple[torch.Tensor, dict[int, Any]] | None] | None = None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        cache = kv[0][:, 0]  # [R, Rkv+Dr] this layer's latent rows (kv[1] is a view of them)
        t = x.shape[0]
        if self.q_lora:
            q_latent, kv_a = self.qkv_a_proj(x)  # [T, Rq], [T, Rkv+Dr]
            q = self.q_b_proj(self.q_a_layernorm(q_latent))  # [T, Hq*(Dn+Dr)]
        else:
            q, kv_a = self.q_kv_a_proj(x)  # [T, Hq*(Dn+Dr)], [T, Rkv+Dr]
        q = q.view(t, self.h, self.dn + self.dr)
        q_nope = q[..., : self.dn]  # [T, Hq, Dn]
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.kv_rank)  # [Hq, Dn+Dv, Rkv]
        lora = self.kv_b_lora() if self.kv_b_lora is not None else None
        if x.is_cuda or self.triton_on_cpu:
            from coordinator.model.kernels.fused_ops import mla_rope_store

            if self._inv_freq is None or self._inv_freq.device != x.device:
                self._inv_freq = self.rotary.inv_freq(x.device)  # [Dr/2], once: not per layer per step
            norm = (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
            q_rope = mla_rope_store(
                q, kv_a, batch.positions, batch.write_index, self._inv_freq, norm, cache,
                self.rotary.interleave, self.rope_in_float32, self.rotary.factor,
            )  # fmt: skip
            o = self._attend_cuda(q_nope, q_rope, cache, batch, w, lora)
        else:
            kv_latent, k_rope = kv_a.split([self.kv_rank, self.dr], dim=-1)  # [T, Rkv], [T, Dr]
            c = self.kv_a_layernorm(kv_latent)  # [T, Rkv]
            q_rope, k_rope = self._rotate(q[..., self.dn :], k_rope[:, None, :], batch.positions)
            cache[batch.write_index] = torch.cat([c, k_rope[:, 0]], dim=-1)
            o = self._attend_torch(q_nope, q_rope, cache, batch, w, lora)
        return self.o_proj(o.reshape(t, self.h * self.dv))

    def _attend_cuda(
        self,
        q_nope: torch.Tensor,  # [T, Hq, Dn]
        q_rope: torch.Tensor,  # [T, Hq, Dr] rotated
        cache: torch.Tensor,  # [R, Rkv+Dr], the step's rows written
        batch: ForwardBatch,
        w: torch.Tensor,  # [Hq, Dn+Dv, Rkv] kv_b_proj: W_UK then W_UV per head
        lora: tuple[torch.Tensor, dict[int, Any]] | None,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """Absorbed form for every token: two batched GEMMs around the Triton kernel."""
        from coordinator.model.kernels.mla_attention import mla_attention_triton

        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, : self.dn])  # [Hq, T, Rkv] = W_UK^T q_nope
        per_slot = self._lora_rows(lora)
        for rows, a, b in per_slot:  # + (B_UK A)^T q_nope for each adapter's tokens
            q_lat[:, rows] += torch.bmm(q_nope[rows].transpose(0, 1), b[:, : self.dn]) @ a
        o_lat = mla_attention_triton(
            q_lat,
            q_rope,
            cache,
            batch.page_table,
            batch.token_seq,
            batch.positions,
            batch.page_size,
            self.scale,
        )  # [Hq, T, Rkv]
        o = torch.bmm(o_lat, w[:, self.dn :].transpose(1, 2))  # [Hq, T, Dv] = W_UV o_lat
        for rows, a, b in per_slot:  # + B_UV A o_lat
            o[:, rows] += torch.bmm(o_lat[:, rows] @ a.T, b[:, self.dn :].transpose(1, 2))
        return o.transpose(0, 1)

    def _lora_rows(
        self, lora: tuple[torch.Tensor, dict[int, Any]] | None
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # (token rows, a [r, Rkv], b [Hq, Dn+Dv, r])
        if lora is None:
            return []
        slots, per_slot = lora
        out = []
        for slot, p in per_slot.items():
            rows = torch.where(slots == slot)[0]
            if rows.numel():
                out.append((rows, p.a, p.b.view(self.h, self.dn + self.dv, -1)))
        return out

    def _attend_torch(
        self,
        q_nope: torch.Tensor,  # [T, Hq, Dn]
        q_rope: torch.Tensor,  # [T, Hq, Dr] rotated
        cache: torch.Tensor,  # [R, Rkv+Dr], the step's rows written
        batch: ForwardBatch,
        w: torch.Tensor,  # [Hq, Dn+Dv, Rkv] kv_b_proj: W_UK then W_UV per head
        lora: tuple[torch.Tensor, dict[int, Any]] | None,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """The plain-torch path, one sequence chunk at a time. Decode rows (one new token) attend
        in the absorbed form; prefill/extend chunks decompress their sequence's cached latents
        into per-head K/V (HF's own maths and rounding, and fewer operations than the absorbed
        form once a chunk has more than a few dozen tokens: per key, Hq*(Dn+Dv)*Rkv to
        decompress against Hq*(2*Rkv - Dn - Dv) extra per query with the absorbed form)."""
        out = q_nope.new_empty(q_nope.shape[0], self.h, self.dv)
        for b, ch in enumerate(batch.chunks):
            rows = ch.kv_index if ch.kv_index is not None else _cache_rows(batch, b, ch.past + ch.length)
            kv = cache[rows]  # [S, Rkv+Dr]
            span = slice(ch.start, ch.start + ch.length)
            slot = int(lora[0][ch.start]) if lora is not None else -1
            wc = w  # a sequence has one adapter: its kv_b_proj weight with the LoRA folded in
            if lora is not None and slot in lora[1]:
                p = lora[1][slot]
                wc = w + (p.b @ p.a).view(w.shape)
            if ch.length == 1:
                # NOTE: absorbed in float32: bf16 q_lat / o_lat would add roundings HF does not have
                f32 = torch.float32
                q_lat = torch.bmm(
                    q_nope[span].transpose(0, 1).to(f32), wc[:, : self.dn].to(f32)
                )  # [Hq, 1, Rkv]
                o_lat = latent_attention(q_lat, q_rope[span].to(f32), kv.to(f32), ch.past, self.scale)
                o = torch.bmm(o_lat, wc[:, self.dn :].transpose(1, 2).to(f32))  # [Hq, 1, Dv]
                out[span] = o.transpose(0, 1).to(out.dtype)
            else:
                out[span] = self._decompressed(q_nope[span], q_rope[span], kv, ch.past, wc)
        return out

    def _decompressed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, past: int, w: torch.Tensor
    ) -> torch.Tensor:  # [n, Hq, Dv]
        """q_nope [n, Hq, Dn], q_rope [n, Hq, Dr], kv [S, Rkv+Dr] the sequence's cached rows,
        w [Hq, Dn+Dv, Rkv] kv_b_proj's weight."""
        n, s = q_nope.shape[0], kv.shape[0]
        lat, k_rope = kv.split([self.kv_rank, self.dr], dim=-1)
        kv_full = F.linear(lat, w.reshape(-1, self.kv_rank)).view(s, self.h, self.dn + self.dv)
        k_nope, v = kv_full.split([self.dn, self.dv], dim=-1)  # [S, Hq, Dn], [S, Hq, Dv]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [Hq, n, Dn+Dr]
        k = torch.cat([k_nope, k_rope[:, None, :].expand(s, self.h, self.dr)], dim=-1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scale  # [Hq, n, S]
        mask = torch.arange(s)[None, :] <= (past + torch.arange(n))[:, None]  # [n, S]
        probs = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(q.dtype), v.transpose(0, 1)).transpose(0, 1)  # [n, Hq, Dv]

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


def latent_attention(
    q_lat: torch.Tensor,  # [Hq, n, Rkv] one chunk's queries in the latent space
    q_rope: torch.Tensor,  # [n, Hq, Dr] rotated query part
    kv: torch.Tensor,  # [S, Rkv+Dr] the sequence's cached rows, positions 0..S-1
    past: int,  # query i sits at position past + i
    scale: float,
) -> torch.Tensor:  # [Hq, n, Rkv]
    """Absorbed-form causal attention of one chunk, all heads over the shared latent rows."""
    n, s, rkv = q_lat.shape[1], kv.shape[0], q_lat.shape[2]
    lat, k_rope = kv[:, :rkv], kv[:, rkv:]
    scores = torch.matmul(q_lat, lat.T) + torch.matmul(q_rope.transpose(0, 1), k_rope.T)  # [Hq, n, S]
    mask = torch.arange(s)[None, :] <= (past + torch.arange(n))[:, None]  # [n, S]
    scores = (scores * scale).masked_fill(~mask.to(scores.device), float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
    return torch.matmul(probs, lat)


def mla_attention_torch(
    q_lat: torch.Tensor,  # [Hq, T, Rkv]
    q_rope: torch.Tensor,  # [T, Hq, Dr]
    cache: torch.Tensor,  # [R, Rkv+Dr], the step's rows written
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [Hq, T, Rkv]
    """Absorbed-form attention of a whole step in plain torch: the reference of the Triton kernel."""
    out = q_lat.new_empty(q_lat.shape)
    for b, ch in enumerate(batch.chunks):
        rows = ch.kv_index if ch.kv_index is not None else _cache_rows(batch, b, ch.past + ch.length)
        span = slice(ch.start, ch.start + ch.length)
        out[:, span] = latent_attention(q_lat[:, span], q_rope[span], cache[rows], ch.past, scale)
    return out


def _cache_rows(batch: ForwardBatch, b: int, s: int) -> torch.Tensor:  # [s] cache rows of sequence b
    p = torch.arange(s, device=batch.page_table.device)
    return batch.page_table[b].long()[p // batch.page_size] * batch.page_size + p % batch.page_size
