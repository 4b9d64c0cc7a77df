"""MoE-LoRA kernels, split strategy (prefill-sized batches with adapters mixed in a block):
a separate shrink kernel per GEMM, then the base GEMM with the expand of every adapter present.

    shrink13  v13[r] = A13[a_r, s] x[t_r]                  [Rw, BR]   per block, per adapter
    gate_up   act[r] = silu(.) * (.) of W13[s] x + B13[a_r, s] v13[r]   the delta before silu
    shrink2   v2[r]  = A2[a_r, s] act[r]
    down      y[p_r] = w * (W2[s] act[r] + B2[a_r, s] v2[r])

Rows of each adapter present in a block are multiplied by its (A, B) of this slot, the other
rows masked to zero; base-only blocks skip all LoRA work.

Shapes: H hidden, I intermediate, S slots, L adapter slots, R rank, BM/BN/BK/BR tiles,
Rw aligned rows, P pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_server.kernels.grouped_gemm import (
    _down_acc,
    _gate_up_acc,
    _mma,
    _store_act,
    _store_weighted,
    _tile_ids,
)
from gpu_server.kernels.moe_lora_inloop import _block_rows


@triton.jit(do_not_specialize=["num_m_blocks"])
def _shrink_kernel(
    in_ptr,  # [T, D] (GATHER: row = token of the pair) or [Rw, D] (row = aligned row)
    la_ptr,  # [L, S, R, D]
    v_ptr,  # [Rw, BLOCK_R]
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    adapter_ptr,  # [T] int32
    num_adapters,
    fan_in,
    rank,
    TOP_K,
    stride_in,
    stride_al,
    stride_as,
    stride_ar,
    stride_v,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slot, rows, live, pair, ad = _block_rows(
        pid_m, block_slot_ptr, start_ptr, count_ptr, sorted_ptr, adapter_ptr, TOP_K, BLOCK_M
    )
    if slot < 0:
        return
    src = pair // TOP_K if GATHER else rows
    in_rows = in_ptr + src.to(tl.int64)[:, None] * stride_in  # [BM, 1]
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = offs_r < rank
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if tl.max(ad) >= 0:
        for a in range(0, num_adapters):
            sel = ad == a  # [BM]
            if tl.max(sel.to(tl.int32)) > 0:
                la = la_ptr + a * stride_al + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
                for k in range(0, tl.cdiv(fan_in, BLOCK_K)):
                    kk = k * BLOCK_K + offs_k
                    k_ok = kk < fan_in
                    xa = tl.load(
                        in_rows + kk[None, :], mask=sel[:, None] & k_ok[None, :], other=0.0
                    )  # [BM, BK]
                    at = tl.load(la + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BK, BR]
                    v = _mma(xa, at, v, UPCAST, IEEE)
    out = v_ptr + rows.to(tl.int64)[:, None] * stride_v + offs_r[None, :]
    tl.store(out, v.to(v_ptr.dtype.element_ty))


@triton.jit
def _expand(acc, v, ad, lb_ptr, slot, offs_n, num_adapters, rank, stride_bl, stride_bs, stride_bn,
            BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += rows of each adapter a present: v [BM, BR] @ B[a, slot, offs_n, :]^T."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    for a in range(0, num_adapters):
        sel = ad == a
        if tl.max(sel.to(tl.int32)) > 0:
            lb = lb_ptr + a * stride_bl + slot.to(tl.int64) * stride_bs + offs_r[:, None]
            bt = tl.load(lb + offs_n[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)  # [BR, BN]
            acc = _mma(tl.where(sel[:, None], v, tl.zeros_like(v)), bt, acc, UPCAST, IEEE)
    return acc


@triton.jit(do_not_specialize=["num_m_blocks"])
def _gate_up_expand_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [S, 2I, H]
    v_ptr,  # [Rw, BLOCK_R] shrink13 output
    lb_ptr,  # [L, S, 2I, R]
    act_ptr,  # [Rw, I]
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    adapter_ptr,
    num_m_blocks,
    num_adapters,
    hidden,
    inter,
    rank,
    TOP_K,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_v,
    stride_bl,
    stride_bs,
    stride_bn,
    stride_act,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, inter, BLOCK_N, GROUP_M)
    slot, rows, live, pair, ad = _block_rows(
        pid_m, block_slot_ptr, start_ptr, count_ptr, sorted_ptr, adapter_ptr, TOP_K, BLOCK_M
    )
    if slot < 0:
        return
    tok = pair // TOP_K  # padding rows read token 0: harmless, and it keeps the A loads unmasked
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter  # wrap: loads stay in bounds
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g, acc_u = _gate_up_acc(a_ptrs, g_ptrs, u_ptrs, hidden, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                UPCAST, IEEE)  # fmt: skip
    if tl.max(ad) >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_v + offs_r[None, :])  # [BM, BR]
        acc_g = _expand(acc_g, v, ad, lb_ptr, slot, offs_n, num_adapters, rank, stride_bl, stride_bs, stride_bn,
                        BLOCK_R, UPCAST, IEEE)  # fmt: skip
        acc_u = _expand(acc_u, v, ad, lb_ptr, slot, inter + offs_n, num_adapters, rank, stride_bl, stride_bs,
                        stride_bn, BLOCK_R, UPCAST, IEEE)  # fmt: skip
    _store_act(acc_g, acc_u, act_ptr, rows, pid_n, inter, stride_act, BLOCK_N)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_expand_kernel(
    act_ptr,  # [Rw, I]
    w_ptr,  # [S, H, I]
    v_ptr,  # [Rw, BLOCK_R] shrink2 output
    lb_ptr,  # [L, S, H, R]
    y_ptr,  # [P, H]
    topw_ptr,  # [P] float32
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    adapter_ptr,
    num_m_blocks,
    num_adapters,
    hidden,
    inter,
    rank,
    TOP_K,
    stride_act,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_v,
    stride_bl,
    stride_bs,
    stride_bn,
    stride_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, hidden, BLOCK_N, GROUP_M)
    slot, rows, live, pair, ad = _block_rows(
        pid_m, block_slot_ptr, start_ptr, count_ptr, sorted_ptr, adapter_ptr, TOP_K, BLOCK_M
    )
    if slot < 0:
        return
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_k[None, :]  # [BM, BK]
    b_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = _down_acc(a_ptrs, b_ptrs, inter, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE)
    if tl.max(ad) >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_v + offs_r[None, :])
        acc = _expand(acc, v, ad, lb_ptr, slot, offs_n, num_adapters, rank, stride_bl, stride_bs, stride_bn,
                      BLOCK_R, UPCAST, IEEE)  # fmt: skip
    _store_weighted(acc, topw_ptr, y_ptr, pair, live, pid_n, hidden, stride_yp, BLOCK_N)
