"""Grouped GEMMs over aligned blocks: gate_up with SiLU-and-mul, and down with the routing weight.

A program computes one [BLOCK_M, BLOCK_N] tile of one block of rows; every row of a block
belongs to the same slot (see align.py), so the weight tile is that slot's.

    gate_up:  act[r, n] = silu(x[t_r] . w13[s, n]) * (x[t_r] . w13[s, I + n])   r: aligned row
    down:     y[p_r, n] = weights[p_r] * (act[r] . w2[s, n])                     p_r: pair of row r

``act`` lives in aligned-row order, so the down GEMM reads its A tiles contiguously; ``y`` lives
in pair order (t*K+k) so the reduction over k reads each token's rows side by side.

Shapes: H hidden, I intermediate, S slots, R aligned rows, P = T*K pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_server.kernels.align import Alignment
from gpu_server.kernels.config import GemmConfig


@triton.jit
def _tile_ids(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (m block, n tile), GROUP_M m blocks at a time so their A rows stay in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # NOTE: the CPU interpreter gets low-precision dots wrong, so it computes them in fp32
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _block_rows(pid_m, slot, start_ptr, count_ptr, sorted_ptr, BLOCK_M: tl.constexpr):
    """Block pid_m of slot `slot` (>= 0): rows [BM], live [BM] (not padding), the sorted entry of
    each row [BM] (a pair t*K+k; 0 on padding rows)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows - tl.load(start_ptr + slot) < tl.load(count_ptr + slot)
    pair = tl.load(sorted_ptr + rows, mask=live, other=0)
    return rows, live, pair


@triton.jit
def _load_a(ptrs, k, fan_in, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step k of an A tile [BM, BK]; the K tail reads zeros unless EVEN_K."""
    if EVEN_K:
        a = tl.load(ptrs)
    else:
        a = tl.load(ptrs, mask=(tl.arange(0, BLOCK_K) < fan_in - k * BLOCK_K)[None, :], other=0.0)
    return a


@triton.jit
def _load_b(ptrs, k, fan_in, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step k of a B tile [BK, BN]; the K tail reads zeros unless EVEN_K."""
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=(tl.arange(0, BLOCK_K) < fan_in - k * BLOCK_K)[:, None], other=0.0)
    return b


@triton.jit
def _gate_up_acc(a_ptrs, g_ptrs, u_ptrs, hidden, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """(gate, up) accumulators [BM, BN] float32 over the whole K = hidden loop."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        a = _load_a(a_ptrs, k, hidden, BLOCK_K, EVEN_K)
        g = _load_b(g_ptrs, k, hidden, BLOCK_K, EVEN_K)
        u = _load_b(u_ptrs, k, hidden, BLOCK_K, EVEN_K)
        acc_g = _mma(a, g, acc_g, UPCAST, IEEE)
        acc_u = _mma(a, u, acc_u, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    return acc_g, acc_u


@triton.jit
def _down_acc(a_ptrs, b_ptrs, inter, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """The down accumulator [BM, BN] float32 over the whole K = inter loop."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        a = _load_a(a_ptrs, k, inter, BLOCK_K, EVEN_K)
        b = _load_b(b_ptrs, k, inter, BLOCK_K, EVEN_K)
        acc = _mma(a, b, acc, UPCAST, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _store_act(acc_g, acc_u, act_ptr, rows, pid_n, inter, stride_ar, BLOCK_N: tl.constexpr):
    """act[rows, tile n] <- silu(gate) * up, rounded once to act's dtype."""
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_ar + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=cols[None, :] < inter)


@triton.jit
def _store_weighted(acc, topw_ptr, y_ptr, pair, live, pid_n, hidden, stride_yp, BLOCK_N: tl.constexpr):
    """y[pair, tile n] <- routing weight * acc for the live rows."""
    # NOTE: routing weights are float32; the product is rounded once, to the activation dtype
    acc = acc * tl.load(topw_ptr + pair, mask=live, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + cols[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < hidden))


@triton.jit(do_not_specialize=["num_m_blocks"])
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [S, 2I, H]
    act_ptr,  # [R, I]
    sorted_ptr,  # [R]
    block_slot_ptr,  # [B]
    start_ptr,  # [S]
    count_ptr,  # [S]
    num_m_blocks,
    hidden,
    inter,
    TOP_K,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, inter, BLOCK_N, GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows, live, pair = _block_rows(pid_m, slot, start_ptr, count_ptr, sorted_ptr, BLOCK_M)  # [BM] each
    tok = pair // TOP_K  # padding rows read token 0: harmless, and it keeps the A loads unmasked
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter  # wrap: loads stay in bounds
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
    g_ptrs = (
        w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    )  # [BK, BN]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g, acc_u = _gate_up_acc(a_ptrs, g_ptrs, u_ptrs, hidden, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                UPCAST, IEEE)  # fmt: skip
    _store_act(acc_g, acc_u, act_ptr, rows, pid_n, inter, stride_ar, BLOCK_N)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_kernel(
    act_ptr,  # [R, I]
    w_ptr,  # [S, H, I]
    y_ptr,  # [P, H]
    topw_ptr,  # [P] float32
    sorted_ptr,  # [R]
    block_slot_ptr,  # [B]
    start_ptr,  # [S]
    count_ptr,  # [S]
    num_m_blocks,
    hidden,
    inter,
    stride_ar,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, hidden, BLOCK_N, GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows, live, pair = _block_rows(pid_m, slot, start_ptr, count_ptr, sorted_ptr, BLOCK_M)  # [BM] each
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    # every row of a used block was written by the gate_up kernel, padding rows included
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]  # [BM, BK]
    b_ptrs = (
        w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    )  # [BK, BN]
    acc = _down_acc(a_ptrs, b_ptrs, inter, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE)
    _store_weighted(acc, topw_ptr, y_ptr, pair, live, pid_n, hidden, stride_yp, BLOCK_N)


def _flags(x: torch.Tensor) -> dict:
    # a CPU tensor means the Triton interpreter; fp32 inputs keep full fp32 products (no tf32)
    upcast = x.device.type == "cpu"
    return {"UPCAST": upcast, "IEEE": upcast or x.dtype == torch.float32}


def gate_up(
    x: torch.Tensor, w13: torch.Tensor, al: Alignment, top_k: int, cfg: GemmConfig, act: torch.Tensor
) -> None:
    """act [R, I] <- silu(gate) * up for every row of every used block."""
    h, inter = x.shape[1], w13.shape[1] // 2
    assert x.stride(1) == 1 and act.stride(1) == 1, f"{x.stride()=} {act.stride()=}"
    grid = (al.max_blocks * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w13, act, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count,
        al.max_blocks, h, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=h % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_flags(x),
    )  # fmt: skip


def down(
    act: torch.Tensor, w2: torch.Tensor, topw: torch.Tensor, al: Alignment, cfg: GemmConfig, y: torch.Tensor
) -> None:
    """y [P, H] <- weight * (act @ w2[slot]^T) for every routed pair; other rows untouched."""
    h, inter = w2.shape[1], w2.shape[2]
    assert act.stride(1) == 1 and y.stride(1) == 1, f"{act.stride()=} {y.stride()=}"
    grid = (al.max_blocks * triton.cdiv(h, cfg.block_n),)
    _down_kernel[grid](
        act, w2, y, topw, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count,
        al.max_blocks, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_flags(act),
    )  # fmt: skip
