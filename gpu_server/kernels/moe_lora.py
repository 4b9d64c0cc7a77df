"""Fused MoE with multi-adapter LoRA: shrink and expand grouped by expert slot and adapter.

    gate_up = W13[s] x + B13[a, s] (A13[a, s] x)        a = token_adapter[t], -1 = base
    act     = silu(gate_up[:I]) * gate_up[I:]
    y       = weights[t, k] * (W2[s] act + B2[a, s] (A2[a, s] act))
    out[t]  = sum_k y

The (token, k) pairs are aligned by slot exactly as in the plain fused MoE (align.py), so each
expert's base weights are streamed once however many adapters its tokens use. Inside a block,
rows may carry different adapters: for every adapter present in the block, the rows of that
adapter are multiplied by its (A, B) of this slot (the other rows are masked to zero), so the
LoRA tiles read are those of the (slot, adapter) pairs that occur, and nothing else.

    shrink13  v13[r] = A13[a_r, s] x[t_r]                 [Rw, R13]   per block, per adapter
    gate_up   act[r] = silu(.) * (.) of W13[s] x + B13[a_r, s] v13[r]   the delta before silu
    shrink2   v2[r]  = A2[a_r, s] act[r]                   [Rw, R2]
    down      y[p_r] = w * (W2[s] act[r] + B2[a_r, s] v2[r])
    sum_k     (reduce.py)

The shrink outputs are rounded to the activation dtype, as PEFT's lora_A outputs are. Base
rows (a = -1) and blocks without adapters skip all LoRA work. No host synchronisation, so the
whole thing can be captured in a CUDA graph.

Beside (not inside) kernels/grouped_gemm.py so the base kernels stay as tuned; the alignment,
tile order, reduction over k and launch configs are shared.

Shapes: T tokens, K top-k, H hidden, I intermediate, S slots, L adapter slots, R13/R2 ranks
(BLOCK_R: padded to a power of two >= 16), P = T*K pairs, Rw aligned rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertmesh.lora import MoELoRAWeights
from gpu_server.kernels.align import Alignment, align_pairs
from gpu_server.kernels.config import MoeConfig, default_config
from gpu_server.kernels.fused_moe import check_inputs
from gpu_server.kernels.grouped_gemm import _flags, _mma, _tile_ids
from gpu_server.kernels.reduce import sum_k


@triton.jit
def _block_rows(
    pid_m, block_slot_ptr, start_ptr, count_ptr, sorted_ptr, adapter_ptr, TOP_K, BLOCK_M: tl.constexpr
):
    """(slot, rows [BM], live [BM], pair [BM], adapter of each row [BM] (-1: base or padding))."""
    slot = tl.load(block_slot_ptr + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows - tl.load(start_ptr + tl.maximum(slot, 0)) < tl.load(count_ptr + tl.maximum(slot, 0))
    pair = tl.load(sorted_ptr + rows, mask=live, other=0)
    ad = tl.load(adapter_ptr + pair // TOP_K, mask=live, other=-1)
    return slot, rows, live, pair, ad


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
def _gate_up_lora_kernel(
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
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < hidden - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        acc_g = _mma(a, g, acc_g, UPCAST, IEEE)
        acc_u = _mma(a, u, acc_u, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if tl.max(ad) >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_v + offs_r[None, :])  # [BM, BR]
        acc_g = _expand(acc_g, v, ad, lb_ptr, slot, offs_n, num_adapters, rank, stride_bl, stride_bs, stride_bn,
                        BLOCK_R, UPCAST, IEEE)  # fmt: skip
        acc_u = _expand(acc_u, v, ad, lb_ptr, slot, inter + offs_n, num_adapters, rank, stride_bl, stride_bs,
                        stride_bn, BLOCK_R, UPCAST, IEEE)  # fmt: skip
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=cols[None, :] < inter)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_lora_kernel(
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < inter - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _mma(a, b, acc, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    if tl.max(ad) >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + rows.to(tl.int64)[:, None] * stride_v + offs_r[None, :])
        acc = _expand(acc, v, ad, lb_ptr, slot, offs_n, num_adapters, rank, stride_bl, stride_bs, stride_bn,
                      BLOCK_R, UPCAST, IEEE)  # fmt: skip
    # NOTE: routing weights are float32; the product is rounded once, to the activation dtype
    acc = acc * tl.load(topw_ptr + pair, mask=live, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < hidden))


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs >= 16


def check_lora(x: torch.Tensor, w13: torch.Tensor, lora: MoELoRAWeights, token_adapter: torch.Tensor) -> None:
    s, i2, h = w13.shape
    assert lora.a13.shape[1] == s and lora.a13.shape[3] == h, f"{lora.a13.shape=} {w13.shape=}"
    assert lora.b13.shape[2] == i2 and lora.a2.shape[3] == i2 // 2, f"{lora.b13.shape=} {lora.a2.shape=}"
    for t in (lora.a13, lora.b13, lora.a2, lora.b2):
        assert t.dtype == x.dtype and t.device == x.device and t.stride(-1) == 1, f"{t.dtype=} {t.device=}"
    assert token_adapter.shape == (x.shape[0],) and not token_adapter.is_floating_point(), (
        f"{token_adapter.shape=}"
    )


def _shrink(src, la, al: Alignment, adapters, top_k, gather: bool, block_k: int) -> torch.Tensor:
    """v [Rw, BLOCK_R] <- A[a_r, s] src_r for rows with an adapter, 0 elsewhere."""
    rank, fan_in = la.shape[2], la.shape[3]
    block_r = _block_r(rank)
    v = torch.empty(al.sorted_pairs.shape[0], block_r, dtype=src.dtype, device=src.device)
    _shrink_kernel[(al.max_blocks,)](
        src, la, v, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        la.shape[0], fan_in, rank, top_k,
        src.stride(0), la.stride(0), la.stride(1), la.stride(2), v.stride(0),
        GATHER=gather, BLOCK_M=al.block_m, BLOCK_K=min(block_k, 64), BLOCK_R=block_r, **_flags(src),
    )  # fmt: skip
    return v


def fused_moe_lora(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    slot_ids: torch.Tensor,  # [T, K] int, -1 = not here
    weights: torch.Tensor,  # [T, K] float32
    lora: MoELoRAWeights,  # [L, S, ...] in x's dtype
    token_adapter: torch.Tensor,  # [T] int, -1 = base; must be < L (checked by the caller)
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H]
    check_inputs(x, w13, w2, slot_ids, weights)
    check_lora(x, w13, lora, token_adapter)
    t, h = x.shape
    num_slots, inter = w13.shape[0], w2.shape[2]
    top_k = slot_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if t == 0 or top_k == 0:
        return out.zero_()
    cfg = (config or default_config(t, top_k, num_slots)).fitted(x.element_size())
    x = x.contiguous()
    slot_ids = slot_ids.to(torch.int32).contiguous()
    adapters = token_adapter.to(torch.int32).contiguous()
    topw = weights.to(torch.float32).contiguous()
    num_adapters = lora.num_adapters
    al = align_pairs(slot_ids, num_slots, cfg.block_m)
    gu, dn = cfg.gate_up, cfg.down
    v13 = _shrink(x, lora.a13, al, adapters, top_k, True, gu.block_k)
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [Rw, I]
    r13 = lora.a13.shape[2]
    _gate_up_lora_kernel[(al.max_blocks * triton.cdiv(inter, gu.block_n),)](
        x, w13, v13, lora.b13, act, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r13, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), v13.stride(0),
        lora.b13.stride(0), lora.b13.stride(1), lora.b13.stride(2), act.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, BLOCK_R=_block_r(r13), GROUP_M=gu.group_m,
        EVEN_K=h % gu.block_k == 0, num_warps=gu.num_warps, num_stages=gu.num_stages, **_flags(x),
    )  # fmt: skip
    v2 = _shrink(act, lora.a2, al, adapters, top_k, False, dn.block_k)
    y = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)  # [P, H]
    r2 = lora.a2.shape[2]
    _down_lora_kernel[(al.max_blocks * triton.cdiv(h, dn.block_n),)](
        act, w2, v2, lora.b2, y, topw, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count, adapters,
        al.max_blocks, num_adapters, h, inter, r2, top_k,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), v2.stride(0),
        lora.b2.stride(0), lora.b2.stride(1), lora.b2.stride(2), y.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, BLOCK_R=_block_r(r2), GROUP_M=dn.group_m,
        EVEN_K=inter % dn.block_k == 0, num_warps=dn.num_warps, num_stages=dn.num_stages, **_flags(act),
    )  # fmt: skip
    sum_k(y, slot_ids, out)
    return out
