"""MoE-LoRA kernels, in-loop strategy (decode-sized batches): the shrink rides along the base
GEMM's K loop, so the launches are the plain fused MoE's.

The block's first adapter a0 (the largest id present) is shrunk in the base loop: each x (or
act) tile loaded for the base product is also multiplied by A[a0, s] ([BM, R]); after the loop
the rows of a0 are expanded by B[a0, s] into the base accumulator, before the activation
(gate_up) or the routing weight (down). Any other adapter of the block gets its own shrink pass
over its rows' (L2-resident) tiles. Blocks of one row (decode) only take the first path; blocks
with base rows only pay a masked (no-memory) extra MMA per K step.

Shapes: H hidden, I intermediate, S slots, L adapter slots, R rank, BM/BN/BK/BR tiles,
Rw aligned rows, P pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu_server.kernels.grouped_gemm import _block_rows as _base_rows
from gpu_server.kernels.grouped_gemm import _load_a, _load_b, _mma, _store_act, _store_weighted, _tile_ids


@triton.jit
def _block_rows(
    pid_m, block_slot_ptr, start_ptr, count_ptr, sorted_ptr, adapter_ptr, TOP_K, BLOCK_M: tl.constexpr
):
    """(slot, rows [BM], live [BM], pair [BM], adapter of each row [BM] (-1: base or padding))."""
    slot = tl.load(block_slot_ptr + pid_m)
    rows, live, pair = _base_rows(pid_m, tl.maximum(slot, 0), start_ptr, count_ptr, sorted_ptr, BLOCK_M)
    ad = tl.load(adapter_ptr + pair // TOP_K, mask=live, other=-1)
    return slot, rows, live, pair, ad


@triton.jit
def _load_lora_a(ptrs, k, fan_in, r_ok, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step k of an A^T tile [BK, BR]: columns past the rank (or all, r_ok False) read zeros."""
    if EVEN_K:
        at = tl.load(ptrs, mask=r_ok[None, :], other=0.0)
    else:
        k_ok = tl.arange(0, BLOCK_K) < fan_in - k * BLOCK_K
        at = tl.load(ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
    return at


@triton.jit
def _other_adapters(acc_a, acc_b, in_rows, fan_in, ad, a0, la_ptr, lb_ptr, slot, offs_n, off_b, num_adapters,
                    rank, stride_al, stride_as, stride_ar, stride_bl, stride_bs, stride_bn,
                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, TWO: tl.constexpr, UPCAST: tl.constexpr,
                    IEEE: tl.constexpr):  # fmt: skip
    """Adapters of the block other than a0: shrink over their rows' tiles, expand into acc_a
    (and acc_b, B rows shifted by off_b, when TWO: gate and up share the shrink)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_ok = offs_r < rank
    for a in range(0, num_adapters):
        sel = (ad == a) & (ad != a0)  # [BM]
        if tl.max(sel.to(tl.int32)) > 0:
            la = la_ptr + a * stride_al + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
            v = tl.zeros((acc_a.shape[0], BLOCK_R), dtype=tl.float32)
            for k in range(0, tl.cdiv(fan_in, BLOCK_K)):
                kk = k * BLOCK_K + offs_k
                k_ok = kk < fan_in
                xa = tl.load(in_rows + kk[None, :], mask=sel[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                at = tl.load(la + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BK, BR]
                v = _mma(xa, at, v, UPCAST, IEEE)
            v_lo = v.to(in_rows.dtype.element_ty)
            lb = lb_ptr + a * stride_bl + slot.to(tl.int64) * stride_bs + offs_r[:, None]
            bt = tl.load(lb + offs_n[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)  # [BR, BN]
            acc_a = _mma(v_lo, bt, acc_a, UPCAST, IEEE)
            if TWO:
                bt = tl.load(lb + (off_b + offs_n)[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)
                acc_b = _mma(v_lo, bt, acc_b, UPCAST, IEEE)
    return acc_a, acc_b


@triton.jit(do_not_specialize=["num_m_blocks"])
def _gate_up_lora_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [S, 2I, H]
    la_ptr,  # [L, S, R, H]
    lb_ptr,  # [L, S, 2I, R]
    act_ptr,  # [Rw, I]
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    adapter_ptr,  # [T] int32
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
    stride_al,
    stride_as,
    stride_ar,
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
    a0 = tl.max(ad)  # the block's first adapter (-1: base rows only)
    has = a0 >= 0
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter  # wrap: loads stay in bounds
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < tl.where(has, rank, 0)  # nothing to load for base-only blocks
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt  # [BM, 1]
    a_ptrs = x_rows + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    l_ptrs = (
        la_ptr
        + tl.maximum(a0, 0).to(tl.int64) * stride_al
        + slot.to(tl.int64) * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None]
    )  # [BK, BR]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        a = _load_a(a_ptrs, k, hidden, BLOCK_K, EVEN_K)
        g = _load_b(g_ptrs, k, hidden, BLOCK_K, EVEN_K)
        u = _load_b(u_ptrs, k, hidden, BLOCK_K, EVEN_K)
        at = _load_lora_a(l_ptrs, k, hidden, r_ok, BLOCK_K, EVEN_K)
        acc_g = _mma(a, g, acc_g, UPCAST, IEEE)
        acc_u = _mma(a, u, acc_u, UPCAST, IEEE)
        v = _mma(a, at, v, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
        l_ptrs += BLOCK_K
    if has:
        v_lo = tl.where((ad == a0)[:, None], v, 0.0).to(x_ptr.dtype.element_ty)
        lb = lb_ptr + a0.to(tl.int64) * stride_bl + slot.to(tl.int64) * stride_bs + offs_r[:, None]
        bg = tl.load(lb + offs_n[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)  # [BR, BN]
        bu = tl.load(lb + (inter + offs_n)[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)
        acc_g = _mma(v_lo, bg, acc_g, UPCAST, IEEE)
        acc_u = _mma(v_lo, bu, acc_u, UPCAST, IEEE)
        if tl.min(tl.where(live, ad, a0)) < a0:  # rows of other adapters in this block
            acc_g, acc_u = _other_adapters(
                acc_g, acc_u, x_rows, hidden, ad, a0, la_ptr, lb_ptr, slot, offs_n, inter, num_adapters,
                rank, stride_al, stride_as, stride_ar, stride_bl, stride_bs, stride_bn,
                BLOCK_K, BLOCK_R, True, UPCAST, IEEE,
            )  # fmt: skip
    _store_act(acc_g, acc_u, act_ptr, rows, pid_n, inter, stride_act, BLOCK_N)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_lora_kernel(
    act_ptr,  # [Rw, I]
    w_ptr,  # [S, H, I]
    la_ptr,  # [L, S, R, I]
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
    stride_al,
    stride_as,
    stride_ar,
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
    a0 = tl.max(ad)
    has = a0 >= 0
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < tl.where(has, rank, 0)  # nothing to load for base-only blocks
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_act  # [BM, 1]
    a_ptrs = a_rows + offs_k[None, :]
    b_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    l_ptrs = (
        la_ptr
        + tl.maximum(a0, 0).to(tl.int64) * stride_al
        + slot.to(tl.int64) * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None]
    )  # [BK, BR]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        a = _load_a(a_ptrs, k, inter, BLOCK_K, EVEN_K)
        b = _load_b(b_ptrs, k, inter, BLOCK_K, EVEN_K)
        at = _load_lora_a(l_ptrs, k, inter, r_ok, BLOCK_K, EVEN_K)
        acc = _mma(a, b, acc, UPCAST, IEEE)
        v = _mma(a, at, v, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
        l_ptrs += BLOCK_K
    if has:
        v_lo = tl.where((ad == a0)[:, None], v, 0.0).to(act_ptr.dtype.element_ty)
        lb = lb_ptr + a0.to(tl.int64) * stride_bl + slot.to(tl.int64) * stride_bs + offs_r[:, None]
        bt = tl.load(lb + offs_n[None, :] * stride_bn, mask=r_ok[:, None], other=0.0)  # [BR, BN]
        acc = _mma(v_lo, bt, acc, UPCAST, IEEE)
        if tl.min(tl.where(live, ad, a0)) < a0:
            acc, _unused = _other_adapters(
                acc, acc, a_rows, inter, ad, a0, la_ptr, lb_ptr, slot, offs_n, 0, num_adapters,
                rank, stride_al, stride_as, stride_ar, stride_bl, stride_bs, stride_bn,
                BLOCK_K, BLOCK_R, False, UPCAST, IEEE,
            )  # fmt: skip
    _store_weighted(acc, topw_ptr, y_ptr, pair, live, pid_n, hidden, stride_yp, BLOCK_N)
