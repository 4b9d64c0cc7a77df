"""Attention over the paged KV cache: standard GQA/MHA attention with rotary embeddings.

Shapes: T tokens in the step, Hq query heads, Hk KV heads, D head dim, S cached positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.model.batch import ForwardBatch
from coordinator.model.models.layers import MergedLinear, RMSNorm, Rotary, linear
from expertmesh.config import ModelConfig


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hk, Dk] new keys
    v: torch.Tensor,  # [T, Hk, Dv] new values
    k_cache: torch.Tensor,  # [rows, Hk, Dk] this layer's pool
    v_cache: torch.Tensor,  # [rows, Hk, Dv]
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Writes the new K/V into the cache, then attends causally per sequence.

    On CUDA one Triton kernel reads the cache through the page table for every token of the
    step (coordinator/model/kernels/paged_attention.py); elsewhere the plain-torch loop below.
    """
    k_cache[batch.write_index] = k
    v_cache[batch.write_index] = v
    if q.is_cuda:
        from coordinator.model.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, batch.page_table, batch.token_seq, batch.positions, batch.page_size, scale
        )
    return paged_attention_torch(q, k_cache, v_cache, batch, scale)


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [rows, Hk, Dk], the step's K/V already written
    v_cache: torch.Tensor,  # [rows, Hk, Dv]
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, Hq, Dv]
    """The plain-torch reference (and CPU path): gathers each sequence's rows, one chunk at a time,
    and the single-token chunks (decodes) of the step all at once.

    The query heads that share a KV head are stacked as rows of one matmul against it (GQA
    without a copy of K/V per query head). A CPU decode step of a small model is mostly per-op
    overhead: the decodes' attention is one padded batch of ops, not a batch per sequence."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    hq, hk, dk, dv = q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[-1]
    groups = hq // hk
    decodes = [b for b, c in enumerate(batch.chunks) if c.length == 1]
    if len(decodes) > 1:
        _decode_attention(q, k_cache, v_cache, batch, decodes, scale, out)
    for b, c in enumerate(batch.chunks):
        if len(decodes) > 1 and c.length == 1:
            continue
        s, n = c.past + c.length, c.length
        kv_index = c.kv_index if c.kv_index is not None else _cache_rows(batch, b, s)
        # query head h reads KV head h // groups: rows (g, i) of group-stack j are head j*groups+g, token i
        qs = (
            q[c.start : c.start + n]
            .reshape(n, hk, groups, dk)
            .permute(1, 2, 0, 3)
            .reshape(hk, groups * n, dk)
        )
        ks = k_cache[kv_index].transpose(0, 1)  # [Hk, S, Dk]
        vs = v_cache[kv_index].transpose(0, 1)  # [Hk, S, Dv]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [Hk, G*n, S]
        if n > 1:  # query i (absolute position past+i) sees keys 0..past+i; one token sees all
            mask = (
                torch.arange(s, device=q.device)[None, :]
                <= (c.past + torch.arange(n, device=q.device))[:, None]
            )  # [n, S]
            scores = scores.view(hk, groups, n, s).masked_fill(~mask, float("-inf")).view(hk, groups * n, s)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vs)  # [Hk, G*n, Dv]
        out[c.start : c.start + n] = o.view(hk, groups, n, dv).permute(2, 0, 1, 3).reshape(n, hq, dv)
    return out


def _decode_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [rows, Hk, Dk]
    v_cache: torch.Tensor,  # [rows, Hk, Dv]
    batch: ForwardBatch,
    seqs: list[int],  # B sequences of the step whose chunk is one token
    scale: float,
    out: torch.Tensor,  # [T, Hq, Dv], their rows written
) -> None:
    """One token per sequence, each seeing all its S_b cached keys: the sequences' rows padded
    to the longest (pad keys masked out), so the ops run once for all of them."""
    hq, hk, dk, dv = q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[-1]
    rows = []
    for b in seqs:
        c = batch.chunks[b]
        rows.append(c.kv_index if c.kv_index is not None else _cache_rows(batch, b, c.past + 1))
    index = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [B, S] cache rows, 0-padded
    length = torch.tensor([r.shape[0] for r in rows], device=q.device)  # [B]
    at = torch.tensor([batch.chunks[b].start for b in seqs], device=q.device)  # [B] rows of T
    qs = q[at].view(len(seqs), hk, hq // hk, dk)  # [B, Hk, G, Dk]
    ks = k_cache[index].permute(0, 2, 3, 1)  # [B, Hk, Dk, S]
    vs = v_cache[index].transpose(1, 2)  # [B, Hk, S, Dv]
    scores = torch.matmul(qs, ks) * scale  # [B, Hk, G, S]
    pad = torch.arange(index.shape[1], device=q.device)[None, :] >= length[:, None]  # [B, S]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out[at] = torch.matmul(probs, vs).reshape(len(seqs), hq, dv)  # [B, Hk, G, Dv] -> [B, Hq, Dv]


def _cache_rows(batch: ForwardBatch, b: int, s: int) -> torch.Tensor:  # [s] cache rows of sequence b
    p = torch.arange(s, device=batch.page_table.device)
    return batch.page_table[b].long()[p // batch.page_size] * batch.page_size + p % batch.page_size


class Attention(nn.Module):
    """GQA attention (Qwen2/Qwen3-MoE, Mixtral, OLMoE), q/k/v merged into one projection."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.hq, self.hk, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        parts = {"q_proj": self.hq * self.d, "k_proj": self.hk * self.d, "v_proj": self.hk * self.d}
        self.qkv_proj = MergedLinear(cfg.hidden_size, parts, cfg.qkv_bias, dtype)
        self.o_proj = linear(self.hq * self.d, cfg.hidden_size, dtype, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.hq * self.d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.hk * self.d, cfg.rms_norm_eps, dtype)
        self.clip = cfg.clip_qkv
        self.rotary = Rotary(self.d, cfg.rope_theta, scaling=cfg.rope_scaling)
        self.scale = self.d**-0.5
        self._inv_freq: torch.Tensor | None = None  # the fused CUDA path's rotary frequencies

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        t = x.shape[0]
        if x.is_cuda and self.qk_norm in (None, "head") and self.clip is None and self.d in (64, 128, 256):
            return self._forward_fused(x, batch, kv)
        q, k, v = self.qkv_proj(x)  # [T, Hq*D], [T, Hk*D], [T, Hk*D]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hk, self.d), v.view(t, self.hk, self.d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        o = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.hq * self.d))

    def _forward_fused(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """CUDA: projection, one kernel for q/k norm + rotary + the K/V cache write, attention."""
        from coordinator.model.kernels.fused_ops import qk_norm_rope_store
        from coordinator.model.kernels.paged_attention import paged_attention_triton

        t = x.shape[0]
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, (Hq+2Hk)*D]
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm == "head" else None
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = self.rotary.inv_freq(x.device)  # [D/2], once: not per layer per step
        inv_freq = self._inv_freq
        q = qk_norm_rope_store(
            qkv,
            self.hq,
            self.hk,
            batch.positions,
            batch.write_index,
            inv_freq,
            kv[0],
            kv[1],
            norms,
            self.rotary.factor,
        )  # [T, Hq, D]
        o = paged_attention_triton(
            q, kv[0], kv[1], batch.page_table, batch.token_seq, batch.positions, batch.page_size, self.scale
        )  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.hq * self.d))
