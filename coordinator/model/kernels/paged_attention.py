"""Causal attention straight off the paged KV cache, batched over every token of a step (Triton).

One program per (token, KV head): it loads the ``G = Hq / Hk`` query heads that share the KV
head as the rows of one tile, walks the token's sequence through its page table ``BLOCK_N``
keys at a time and keeps an online softmax (flash attention), so K/V are read in place: no
gather, no GQA copy, no mask tensor. A token at position p sees keys 0..p of its sequence, which
serves decode (one token per sequence) and prefill/extend with a cached prefix (many tokens per
sequence, each its own causal limit) with one kernel and one launch per layer.

Grid and loop bounds depend only on tensor shapes and on values read on the device, so a step
can be captured in a CUDA graph. A token with position -1 (a graph's padding row) sees no keys
and gets zeros.

Shapes: T tokens in the step, B sequences, Hq query heads, Hk KV heads, G = Hq/Hk,
Dk key dim, Dv value dim, R cache rows, W page-table width, P page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, Dk]
    k_ptr,  # [R, Hk, Dk]
    v_ptr,  # [R, Hk, Dv]
    out_ptr,  # [T, Hq, Dv]
    table_ptr,  # [B, W] int32 page ids
    seq_ptr,  # [T] int32 sequence of each token (row of the page table)
    pos_ptr,  # [T] int64 position of each token (-1: padding)
    scale,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_tb,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    gs = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    heads = kvh * GROUP + gs  # [BLOCK_G] query heads of this KV head
    q_ptrs = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dk[None, :]
    q = tl.load(q_ptrs, mask=(gs < GROUP)[:, None] & (dk < DK)[None, :], other=0.0)  # [BLOCK_G, BLOCK_DK]
    if F32_DOT:
        q = q.to(tl.float32)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    n_keys = tl.load(pos_ptr + t).to(tl.int32) + 1  # causal: keys 0..pos
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        live = p < n_keys
        page = tl.load(table_ptr + seq * stride_tb + p // PAGE, mask=live, other=0).to(tl.int64)
        rows = page * PAGE + p % PAGE  # [BLOCK_N] cache rows
        k = tl.load(
            k_ptr + rows[:, None] * stride_kr + kvh * stride_kh + dk[None, :],
            mask=live[:, None] & (dk < DK)[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DK]
        if F32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(prob, axis=1)
        v = tl.load(
            v_ptr + rows[:, None] * stride_vr + kvh * stride_vh + dv[None, :],
            mask=live[:, None] & (dv < DV)[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(prob, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m = m_new
    # NOTE: a padding token (no keys) keeps l_sum == 0: divide by 1 and write zeros
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(gs < GROUP)[:, None] & (dv < DV)[None, :])


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [R, Hk, Dk]
    v_cache: torch.Tensor,  # [R, Hk, Dv]
    page_table: torch.Tensor,  # [B, W] int32
    token_seq: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T] int64
    page_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, Dv]
) -> torch.Tensor:  # [T, Hq, Dv]
    """Attention of each token over keys 0..position of its sequence, K/V already in the cache."""
    t, hq, dk = q.shape
    _, hk, dv = v_cache.shape
    assert hq % hk == 0 and k_cache.shape[1:] == (hk, dk), f"{q.shape=} {k_cache.shape=} {v_cache.shape=}"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert page_table.dtype == torch.int32 and token_seq.dtype == torch.int32, (
        f"{page_table.dtype=} {token_seq.dtype=}"
    )
    if out is None:
        out = q.new_empty(t, hq, dv)
    if t == 0:
        return out
    group = hq // hk
    # tl.dot wants at least 16 rows; the interpreter (CPU) gets float32 dots (its bf16 dot is wrong)
    block_g = max(16, triton.next_power_of_2(group))
    interp = not q.is_cuda
    _paged_attention_kernel[(t, hk)](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        token_seq,
        positions,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        DK=dk,
        DV=dv,
        GROUP=group,
        PAGE=page_size,
        BLOCK_G=block_g,
        BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_N=64 if max(dk, dv) <= 128 else 32,
        F32_DOT=interp or q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out
