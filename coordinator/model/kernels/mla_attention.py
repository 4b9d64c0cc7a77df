"""MLA attention in the absorbed form straight off the paged latent cache, batched over a step (Triton).

The cache holds one row per token: the normalised latent ``c`` (``Rkv`` values) then the
rotated key part ``k_rope`` (``Dr``), shared by every head (coordinator/model/kv_cache.py). With the
non-rotary query already mapped into the latent space (``q_lat = W_UK^T q_nope``, one small
batched GEMM outside), a head's score for key j is ``q_lat . c_j + q_rope . k_rope_j`` and its
value is ``c_j`` itself: multi-query attention with one KV head of width ``Rkv + Dr``, whose
output ``sum_j p_j c_j`` is mapped back through ``W_UV`` outside.

One program per (token, block of ``BLOCK_H`` heads, split of the sequence): the heads are the
rows of one tile, the token's rows are walked through its page table ``BLOCK_N`` at a time with
an online softmax, and each latent tile is loaded once for both the scores and the values. A
token at position p sees rows 0..p of its sequence, so decode, prefill and extend over a cached
prefix share one launch. With few tokens (decode at small batch) the sequence is split into
``splits`` parts whose partial results (output and log-sum-exp) a second kernel merges: one
program per token would leave all but a few SMs idle and be bound by one SM's load latency.
Grid and loop bounds depend only on shapes and on values read on the device (CUDA-graph
capturable); a token with position -1 (padding) gets zeros.

Shapes: T tokens in the step, B sequences, Hq heads, Rkv latent rank, Dr rotary dim, R cache
rows, W page-table width, P page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
SPLIT_BELOW = 8  # split-KV by default only when a step has at most this many (token, head block) programs


@triton.jit
def _mla_attention_kernel(
    ql_ptr,  # [Hq, T, Rkv] queries in the latent space
    qr_ptr,  # [T, Hq, Dr] rotated query part
    c_ptr,  # [R, Rkv + Dr] latent rows
    out_ptr,  # [Hq, T, Rkv], or [T, Hq, S, Rkv] float32 partials when split
    lse_ptr,  # [T, Hq, S] float32 base-2 log-sum-exp of each split (split only)
    table_ptr,  # [B, W] int32 page ids
    seq_ptr,  # [T] int32 sequence of each token
    pos_ptr,  # [T] int64 position of each token (-1: padding)
    scale_log2,  # softmax scale * log2(e): the kernel exponentiates in base 2
    HQ,
    stride_lh,
    stride_lt,
    stride_rt,
    stride_rh,
    stride_c,
    stride_oh,
    stride_ot,
    stride_tb,
    SPLITS: tl.constexpr,
    RKV: tl.constexpr,
    DR: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    cc = tl.arange(0, BLOCK_C)
    rr = tl.arange(0, BLOCK_R)
    hm = heads < HQ
    cm = cc < RKV
    rm = rr < DR
    ql = tl.load(
        ql_ptr + heads[:, None] * stride_lh + t * stride_lt + cc[None, :],
        mask=hm[:, None] & cm[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_C]
    qr = tl.load(
        qr_ptr + t * stride_rt + heads[:, None] * stride_rh + rr[None, :],
        mask=hm[:, None] & rm[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    if F32_DOT:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    n_keys = tl.load(pos_ptr + t).to(tl.int32) + 1  # causal: rows 0..pos
    split = tl.program_id(2)
    per_split = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), SPLITS) * BLOCK_N  # whole blocks per split
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_keys)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        live = p < hi
        page = tl.load(table_ptr + seq * stride_tb + p // PAGE, mask=live, other=0).to(tl.int64)
        rows = c_ptr + (page * PAGE + p % PAGE)[:, None] * stride_c  # [BLOCK_N, 1]
        lat = tl.load(rows + cc[None, :], mask=live[:, None] & cm[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        kr = tl.load(
            rows + RKV + rr[None, :], mask=live[:, None] & rm[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        if F32_DOT:
            lat = lat.to(tl.float32)
            s = tl.dot(ql, tl.trans(lat), input_precision="ieee")
            s += tl.dot(qr, tl.trans(kr.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(kr))  # [BLOCK_H, BLOCK_N]
        s = tl.where(live[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(prob, axis=1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(prob, lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(lat.dtype), lat)  # the latent is the value
        m = m_new
    # NOTE: a padding token or an empty split (no keys) keeps l_sum == 0: divide by 1, zeros
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    if SPLITS == 1:
        o_ptrs = out_ptr + heads[:, None] * stride_oh + t * stride_ot + cc[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hm[:, None] & cm[None, :])
    else:
        part = (t * HQ + heads) * SPLITS + split  # [BLOCK_H] row of [T, Hq, S]
        tl.store(out_ptr + part[:, None] * RKV + cc[None, :], out, mask=hm[:, None] & cm[None, :])
        lse = tl.where(l_sum > 0, m + tl.log2(l_sum), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=hm)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [T, Hq, S, Rkv] float32 normalised partial outputs
    lse_ptr,  # [T, Hq, S] float32
    out_ptr,  # [Hq, T, Rkv]
    HQ,
    stride_oh,
    stride_ot,
    SPLITS: tl.constexpr,
    RKV: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ss = tl.arange(0, SPLITS)
    cc = tl.arange(0, BLOCK_C)
    row = (t * HQ + h) * SPLITS
    lse = tl.load(lse_ptr + row + ss)  # [S]
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # padding token: every weight 0, zeros out
    w = tl.exp2(lse - top)  # [S]
    part = tl.load(part_ptr + (row + ss)[:, None] * RKV + cc[None, :], mask=(cc < RKV)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [BLOCK_C]
    tl.store(out_ptr + h * stride_oh + t * stride_ot + cc, out.to(out_ptr.dtype.element_ty), mask=cc < RKV)


def mla_attention_triton(
    q_lat: torch.Tensor,  # [Hq, T, Rkv]
    q_rope: torch.Tensor,  # [T, Hq, Dr]
    cache: torch.Tensor,  # [R, Rkv + Dr]
    page_table: torch.Tensor,  # [B, W] int32
    token_seq: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T] int64
    page_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [Hq, T, Rkv]
    block_n: int | None = None,
    num_warps: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:  # [Hq, T, Rkv]
    """Attention of each token over cache rows 0..position of its sequence (its own rows written).
    ``splits`` (a power of two): parts each sequence is cut into; by default enough programs to
    cover the GPU's SMs when the step has very few tokens, else 1."""
    hq, t, rkv = q_lat.shape
    dr = cache.shape[1] - rkv
    assert q_rope.shape == (t, hq, dr) and dr > 0, f"{q_lat.shape=} {q_rope.shape=} {cache.shape=}"
    assert q_lat.stride(2) == 1 and q_rope.stride(2) == 1 and cache.stride(1) == 1
    assert page_table.dtype == torch.int32 and token_seq.dtype == torch.int32, (
        f"{page_table.dtype=} {token_seq.dtype=}"
    )
    if out is None:
        out = q_lat.new_empty(hq, t, rkv)
    if t == 0:
        return out
    block_h = 16  # tl.dot wants at least 16 rows
    block_c = max(16, triton.next_power_of_2(rkv))
    interp = not q_lat.is_cuda
    if block_n is None:
        block_n = 64 if block_c >= 256 else 32
    if num_warps is None:  # H100, V2-Lite widths: 64 rows x 8 warps was the fastest of four tiles
        num_warps = 8 if block_c >= 256 else 4
    head_blocks = triton.cdiv(hq, block_h)
    if splits is None:
        # NOTE: H100, V2-Lite widths, context <= 128, per-layer graph replay: batch 1 0.130 ->
        # 0.127 ms with 16 splits, batch 16 0.393 -> 0.406 with 8, batch 64 0.486 -> 0.488 with 4:
        # split only the steps with a handful of programs
        splits = 1
        if t * head_blocks <= SPLIT_BELOW and q_lat.is_cuda:
            sms = torch.cuda.get_device_properties(q_lat.device).multi_processor_count
            splits = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(sms, t * head_blocks)))
    assert splits >= 1 and splits & (splits - 1) == 0, f"{splits=}"
    part, lse = out, out  # unused when splits == 1
    if splits > 1:
        part = torch.empty(t, hq, splits, rkv, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(t, hq, splits, dtype=torch.float32, device=q_lat.device)
    _mla_attention_kernel[(t, head_blocks, splits)](
        q_lat, q_rope, cache, part, lse, page_table, token_seq, positions, scale * LOG2E, hq,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
        out.stride(0), out.stride(1), page_table.stride(0), SPLITS=splits,
        RKV=rkv, DR=dr, PAGE=page_size, BLOCK_H=block_h, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(dr)), BLOCK_N=block_n,
        # the interpreter (CPU) gets float32 dots: its bf16 dot is wrong
        F32_DOT=interp or q_lat.dtype == torch.float32, num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            part,
            lse,
            out,
            hq,
            out.stride(0),
            out.stride(1),
            SPLITS=splits,
            RKV=rkv,
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out
