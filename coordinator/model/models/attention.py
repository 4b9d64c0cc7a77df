"""Attention over the paged KV cache: standard GQA/MHA attention with rotary embeddings.

Shapes: T tokens in the step, Hq query heads, Hk KV heads, D head dim, S cached positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.model.batch import DecodeRows, ForwardBatch
from coordinator.model.models.layers import MergedLinear, RMSNorm, Rotary, linear, rms_norm
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
    hq, hk, dk, dv = q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[-1]
    groups = hq // hk
    decodes = _decode_rows(batch)
    if decodes is not None:
        o_dec = _decode_attention(q, k_cache, v_cache, batch.page_size, decodes, scale)  # [B_d, Hq, Dv]
        if len(decodes.seqs) == q.shape[0]:  # every token decodes: rows 0..T-1 in order
            return o_dec
    out = q.new_empty(q.shape[0], hq, dv)
    if decodes is not None:
        out[decodes.rows] = o_dec
    for b, c in enumerate(batch.chunks):
        if decodes is not None and c.length == 1:
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
        ks = k_cache.transpose(0, 1).index_select(1, kv_index)  # [Hk, S, Dk]
        vs = v_cache.transpose(0, 1).index_select(1, kv_index)  # [Hk, S, Dv]
        scores = _scores(
            qs, ks.transpose(1, 2), _causal_mask(batch, b, groups, q.dtype), scale
        )  # [Hk, G*n, S]
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vs)  # [Hk, G*n, Dv]
        out[c.start : c.start + n] = o.view(hk, groups, n, dv).permute(2, 0, 1, 3).reshape(n, hq, dv)
    return out


def _decode_rows(batch: ForwardBatch) -> DecodeRows | None:
    """The step's one-token chunks: built with the batch on the CPU, here for a batch made
    without them (a test's, or a device's); None when there are none."""
    if batch.decode is not None:
        return batch.decode
    seqs = [b for b, c in enumerate(batch.chunks) if c.length == 1]
    if not seqs:
        return None
    p, dev = batch.page_size, batch.page_table.device
    width = max(-(-(batch.chunks[b].past + 1) // p) for b in seqs)
    index = torch.tensor(seqs, device=dev)
    pages = batch.page_table[index, :width].long().reshape(-1)  # [B_d * W_d]
    length = torch.tensor([batch.chunks[b].past + 1 for b in seqs], device=dev)  # [B_d]
    pad = torch.arange(width * p, device=dev)[None, :] >= length[:, None]  # [B_d, W_d * P]
    mask = torch.zeros(pad.shape, device=dev).masked_fill_(pad, float("-inf"))[:, None, :]
    rows = torch.tensor([batch.chunks[b].start for b in seqs], device=dev)
    return DecodeRows(tuple(seqs), rows, pages, mask)


def _decode_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [R, Hk, Dk]
    v_cache: torch.Tensor,  # [R, Hk, Dv]
    page_size: int,
    d: DecodeRows,  # the B_d sequences of the step whose chunk is one token
    scale: float,
) -> torch.Tensor:  # [B_d, Hq, Dv]
    """One token per sequence, each seeing all its cached keys: whole pages of every sequence
    gathered per KV head, padded to the longest with the pad keys masked, so the ops run once
    for all of them. S = W_d * P keys per sequence.

    The gather's result is head-major, ``[Hk, B_d, S, D]``, one matrix per (KV head,
    sequence) for the batched matmuls; from the CPU cache's head-major storage
    (coordinator/model/kv_cache.py) it copies whole pages, from a row-major one row by row."""
    hq, hk, dk, dv = q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[-1]
    b, s, g = len(d.seqs), d.width, hq // hk
    ks = _pages_by_head(k_cache, page_size, d.pages).view(hk * b, s, dk)  # [Hk*B, S, Dk]
    vs = _pages_by_head(v_cache, page_size, d.pages).view(hk * b, s, dv)  # [Hk*B, S, Dv]
    qs = q.view(q.shape[0], hk, g, dk).transpose(0, 1).index_select(1, d.rows)  # [Hk, B, G, Dk]
    scores = _scores(qs.view(hk * b, g, dk), ks.transpose(1, 2), _head_mask(d, hk, q.dtype), scale)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [Hk*B, G, S]
    o = torch.bmm(probs, vs).view(hk, b, g, dv)  # [Hk, B, G, Dv]
    return o.transpose(0, 1).reshape(b, hq, dv)


def _scores(
    q: torch.Tensor,  # [N, M, Dk]
    k_t: torch.Tensor,  # [N, Dk, S]
    mask: torch.Tensor,  # broadcast to [N, M, S]: 0 where seen, -inf where not
    scale: float,
) -> torch.Tensor:  # [N, M, S]
    """``q @ k_t * scale + mask`` with HF's roundings: in float32 one op (the scale applied to
    the float32 dot is the same rounding as after it), in lower precision three (HF rounds the
    product, then the scaled product, to the activation dtype)."""
    if q.dtype == torch.float32:
        return torch.baddbmm(mask, q, k_t, alpha=scale)
    return torch.bmm(q, k_t) * scale + mask


def _causal_mask(batch: ForwardBatch, b: int, groups: int, dtype: torch.dtype) -> torch.Tensor:  # [G*n, S]
    """Chunk ``b``'s mask for its rows (g, i) of a group stack: query i (position past+i) sees
    keys 0..past+i. The same for every layer: made once per step (in the batch's memo)."""
    key = ("causal", b, groups, dtype)
    got = batch.memo.get(key)
    if got is None:
        c = batch.chunks[b]
        s, n, dev = c.past + c.length, c.length, batch.page_table.device
        seen = (
            torch.arange(s, device=dev)[None, :] <= (c.past + torch.arange(n, device=dev))[:, None]
        )  # [n, S]
        mask = torch.zeros(n, s, dtype=dtype, device=dev).masked_fill_(~seen, float("-inf"))
        got = batch.memo[key] = mask.repeat(groups, 1)
    return got  # type: ignore[return-value]


def _pages_by_head(cache: torch.Tensor, page_size: int, pages: torch.Tensor) -> torch.Tensor:
    """``cache [R, Hk, D]`` -> ``[Hk, len(pages) * P, D]``: the pages' rows, per KV head."""
    return cache.transpose(0, 1).unflatten(1, (-1, page_size)).index_select(1, pages).flatten(1, 2)


def _head_mask(d: DecodeRows, hk: int, dtype: torch.dtype) -> torch.Tensor:  # [Hk*B, 1, S]
    """The decodes' pad mask in the gather's (KV head, sequence) order; the same for every
    layer, so made once per step (kept in the DecodeRows)."""
    key = (hk, dtype)
    got = d.head_masks.get(key)
    if got is None:
        got = d.head_masks[key] = d.mask.to(dtype).repeat(hk, 1, 1)
    return got


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
        self._qk_weight: torch.Tensor | None = None  # see _qk_norm_weight
        self._qk_stamp: tuple[int, ...] = ()

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        t = x.shape[0]
        if x.is_cuda and self.qk_norm in (None, "head") and self.clip is None and self.d in (64, 128, 256):
            return self._forward_fused(x, batch, kv)
        if self.qk_norm != "full":
            return self._forward_joint(x, batch, kv)
        q, k, v = self.qkv_proj(x)  # [T, Hq*D], [T, Hk*D], [T, Hk*D]
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hk, self.d), v.view(t, self.hk, self.d)
        cos, sin_neg = self.rotary.rolled_tables(
            batch.positions, x.dtype, batch.memo if not x.is_cuda else None
        )
        q, k = self.rotary.apply_rolled(q, cos, sin_neg), self.rotary.apply_rolled(k, cos, sin_neg)
        o = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.hq * self.d))

    def _forward_joint(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """q and k as one ``[T, Hq+Hk, D]`` view of the projection: the per-head norms (one
        weight row per head) and the rotary run once for both. Each op works per head row, so
        the numbers are those of q and k done apart; a step of a small model is mostly per-op
        overhead, so half the ops is most of the saving."""
        t, hq, d = x.shape[0], self.hq, self.d
        if self.qkv_proj._forward_hooks:  # LoRA on the projection hooks the module's call
            qkv = torch.cat(self.qkv_proj(x), dim=-1)  # [T, (Hq+2Hk)*D]
        else:
            qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qk = qkv.narrow(1, 0, (hq + self.hk) * d).view(t, hq + self.hk, d)  # [T, Hq+Hk, D]
        v = qkv.narrow(1, (hq + self.hk) * d, self.hk * d).view(t, self.hk, d)  # [T, Hk, D]
        if self.qk_norm == "head":
            qk = rms_norm(qk, self._qk_norm_weight(), self.q_norm.eps)
        cos, sin_neg = self.rotary.rolled_tables(
            batch.positions, x.dtype, batch.memo if not x.is_cuda else None
        )
        qk = self.rotary.apply_rolled(qk, cos, sin_neg)
        q, k = qk.narrow(1, 0, hq), qk.narrow(1, hq, self.hk)
        o = paged_attention(q, k, v, kv[0], kv[1], batch, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, hq * d))

    def _qk_norm_weight(self) -> torch.Tensor:  # [Hq+Hk, D]: q_norm's weight per query head, then k_norm's
        w_q, w_k = self.q_norm.weight, self.k_norm.weight
        if w_q.is_cuda:  # NOTE: never kept on CUDA: one made while a graph is captured holds no values
            return torch.cat([w_q.expand(self.hq, -1), w_k.expand(self.hk, -1)])
        stamp = (w_q.data_ptr(), w_q._version, w_k.data_ptr(), w_k._version)
        if self._qk_weight is None or self._qk_stamp != stamp:  # built once, again if the weights change
            self._qk_weight = torch.cat([w_q.detach().expand(self.hq, -1), w_k.detach().expand(self.hk, -1)])
            self._qk_stamp = stamp
        return self._qk_weight

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
