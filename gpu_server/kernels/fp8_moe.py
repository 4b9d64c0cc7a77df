"""Fused MoE over FP8 block-quantised experts (DeepSeek-V3 / Qwen3-FP8 layout).

The same four stages as fused_moe.py (alignment, gate_up, down, sum over k) with weights stored
as float8_e4m3fn and one float32 scale per ``(SCALE_N, SCALE_K)`` weight block (128x128 in the
published checkpoints): ``W[s, n, k] = w[s, n, k] * scale[s, n // SCALE_N, k // SCALE_K]``.
A program's K tile lies inside one scale column (BLOCK_K divides SCALE_K), so each K step has
one scale per output column (``scale_row [BLOCK_N]``).

Decode is bound by reading the weights, and FP8 halves those bytes. Two ways to form the
product, chosen by ``act_fp8``:

* False (default): the FP8 weight tile is scaled and rounded to the activation dtype (what
  dequantise-to-bf16 gives) and multiplied on the bf16 tensor cores: ``acc += dot(a, w * s)``;
  only the weights are quantised.
* True: the activation tile is quantised too, per token and K tile (scale = amax / 448), and the
  product runs on FP8 tensor cores (Hopper), DeepSeek's W8A8 scheme:
  ``acc += dot(aq, w) * a_scale[:, None] * s[None, :]``; twice the bf16 matmul rate, at the
  cost of the activations' rounding to e4m3.

Shapes: T tokens, K top-k, H hidden, I intermediate, S local slots, R aligned rows, P = T*K.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from gpu_server.kernels.align import Alignment, align_pairs
from gpu_server.kernels.config import GemmConfig, MoeConfig, default_config, fit_shared_memory
from gpu_server.kernels.grouped_gemm import (
    _block_rows,
    _load_a,
    _load_b,
    _store_act,
    _store_weighted,
    _tile_ids,
)
from gpu_server.kernels.reduce import sum_k

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _quant_rows(a):
    """a [BM, BK] -> (e4m3 [BM, BK], scale [BM]): each row's largest magnitude maps to 448."""
    a32 = a.to(tl.float32)
    a_s = tl.maximum(tl.max(tl.abs(a32), axis=1), 1e-12) / 448.0
    return (a32 / a_s[:, None]).to(tl.float8e4nv), a_s


@triton.jit
def _dot_w8a8(aq, a_s, w, s, acc, UPCAST: tl.constexpr):
    """acc + (aq @ w) * a_s[:, None] * s[None, :]; both operands e4m3 (FP8 tensor cores)."""
    if UPCAST:  # the interpreter: the same rounding, multiplied in fp32
        p = tl.dot(aq.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        p = tl.dot(aq, w)
    return acc + p * a_s[:, None] * s[None, :]


@triton.jit
def _dot_w8a16(a, w, s, acc, UPCAST: tl.constexpr):
    """acc + a @ (w * s[None, :]); a [BM, BK] activation dtype, w [BK, BN] fp8, s [BN] fp32.

    The [BK, BN] weight tile is scaled and rounded to the activation dtype and the product
    accumulates in the MMA: rescaling a [BM, BN] product instead costs a second accumulator's
    registers and spills at BLOCK_M >= 64."""
    b = w.to(tl.float32) * s[None, :]
    if UPCAST:
        return tl.dot(a.to(tl.float32), b, acc, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype), acc)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _gate_up_fp8_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [S, 2I, H] fp8
    s_ptr,  # [S, 2I/SCALE_N, ceil(H/SCALE_K)] fp32
    act_ptr,  # [R, I]
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    num_m_blocks,
    hidden,
    inter,
    TOP_K,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_ss,
    stride_sn,
    stride_sk,
    stride_ar,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACT_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, inter, BLOCK_N, GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows, live, pair = _block_rows(pid_m, slot, start_ptr, count_ptr, sorted_ptr, BLOCK_M)
    tok = pair // TOP_K
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    # gate rows n and up rows I+n: I is a multiple of SCALE_N (checked by the caller)
    sg_ptrs = s_ptr + slot.to(tl.int64) * stride_ss + (offs_n // SCALE_N) * stride_sn
    su_ptrs = sg_ptrs + (inter // SCALE_N) * stride_sn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        a = _load_a(a_ptrs, k, hidden, BLOCK_K, EVEN_K)
        g = _load_b(g_ptrs, k, hidden, BLOCK_K, EVEN_K)
        u = _load_b(u_ptrs, k, hidden, BLOCK_K, EVEN_K)
        ks = (k * BLOCK_K) // SCALE_K
        sg = tl.load(sg_ptrs + ks * stride_sk)
        su = tl.load(su_ptrs + ks * stride_sk)
        if ACT_FP8:  # one quantisation of the A tile serves gate and up
            aq, a_s = _quant_rows(a)
            acc_g = _dot_w8a8(aq, a_s, g, sg, acc_g, UPCAST)
            acc_u = _dot_w8a8(aq, a_s, u, su, acc_u, UPCAST)
        else:
            acc_g = _dot_w8a16(a, g, sg, acc_g, UPCAST)
            acc_u = _dot_w8a16(a, u, su, acc_u, UPCAST)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    _store_act(acc_g, acc_u, act_ptr, rows, pid_n, inter, stride_ar, BLOCK_N)


@triton.jit(do_not_specialize=["num_m_blocks"])
def _down_fp8_kernel(
    act_ptr,  # [R, I]
    w_ptr,  # [S, H, I] fp8
    s_ptr,  # [S, ceil(H/SCALE_N), ceil(I/SCALE_K)] fp32
    y_ptr,  # [P, H]
    topw_ptr,  # [P] fp32
    sorted_ptr,
    block_slot_ptr,
    start_ptr,
    count_ptr,
    num_m_blocks,
    hidden,
    inter,
    stride_ar,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_ss,
    stride_sn,
    stride_sk,
    stride_yp,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ACT_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, hidden, BLOCK_N, GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows, live, pair = _block_rows(pid_m, slot, start_ptr, count_ptr, sorted_ptr, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
    b_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    s_ptrs = s_ptr + slot.to(tl.int64) * stride_ss + (offs_n // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        a = _load_a(a_ptrs, k, inter, BLOCK_K, EVEN_K)
        b = _load_b(b_ptrs, k, inter, BLOCK_K, EVEN_K)
        sc = tl.load(s_ptrs + (k * BLOCK_K) // SCALE_K * stride_sk)
        if ACT_FP8:
            aq, a_s = _quant_rows(a)
            acc = _dot_w8a8(aq, a_s, b, sc, acc, UPCAST)
        else:
            acc = _dot_w8a16(a, b, sc, acc, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    _store_weighted(acc, topw_ptr, y_ptr, pair, live, pid_n, hidden, stride_yp, BLOCK_N)


def _fit(cfg: GemmConfig, scale_k: int) -> GemmConfig:
    """BLOCK_K must divide the scale block so a K tile has one scale per column."""
    bk = cfg.block_k
    while scale_k % bk:
        bk //= 2
    assert bk >= 16, f"scale block {scale_k} has no power-of-two divisor >= 16"
    return replace(cfg, block_k=bk)


def default_fp8_config(t: int, top_k: int, num_slots: int, scale_k: int) -> MoeConfig:
    """The bf16 default with BLOCK_K widened to the scale block (at most 128) for decode sizes;
    past them, wider tiles picked by a sweep at DeepSeek-V3 widths on an H100 (rows per slot
    16: 32x128 tiles, 4.47 ms against 4.83 ms for 16x64 at T=512; 64: 64x128 tiles, 7.85 ms
    against 9.72 ms for 32x128 at T=2048; benchmarks/RESULTS.md)."""
    bk = 128
    while scale_k % bk and bk > 16:
        bk //= 2
    rows_per_slot = t * top_k // max(1, num_slots)
    if rows_per_slot > 32:
        g = GemmConfig(block_n=128, block_k=bk, group_m=8, num_warps=4, num_stages=3)
        return MoeConfig(64, g, g)
    if rows_per_slot > 4:
        g = GemmConfig(block_n=128, block_k=bk, group_m=8, num_warps=4, num_stages=4)
        return MoeConfig(32, g, g)
    cfg = default_config(t, top_k, num_slots)

    def widen(g: GemmConfig, b_tiles: int) -> GemmConfig:
        if g.block_k >= bk:
            return g
        # B tiles are FP8 (1 byte) in shared memory; count them at 2 to stay safe
        return fit_shared_memory(replace(g, block_k=bk), cfg.block_m, b_tiles, 2)

    return MoeConfig(cfg.block_m, widen(cfg.gate_up, 2), widen(cfg.down, 1))


def check_fp8_inputs(x, w13, w13_scale, w2, w2_scale, block: tuple[int, int]) -> None:
    s, i2, h = w13.shape
    inter = i2 // 2
    bn, bk = block
    assert w13.dtype == FP8 and w2.dtype == FP8, f"{w13.dtype=} {w2.dtype=}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{x.dtype=}"
    assert x.shape[1] == h and tuple(w2.shape) == (s, h, inter), f"{x.shape=} {w13.shape=} {w2.shape=}"
    assert inter % bn == 0, f"gate/up rows must not share a scale block: I={inter} block {bn}"
    assert tuple(w13_scale.shape) == (s, i2 // bn, -(-h // bk)), f"{w13_scale.shape=}"
    assert tuple(w2_scale.shape) == (s, -(-h // bn), -(-inter // bk)), f"{w2_scale.shape=}"
    assert w13_scale.dtype == torch.float32 and w2_scale.dtype == torch.float32


def fused_moe_fp8(
    x: torch.Tensor,  # [T, H] bf16/fp16/fp32
    w13: torch.Tensor,  # [S, 2I, H] float8_e4m3fn
    w13_scale: torch.Tensor,  # [S, 2I/bn, ceil(H/bk)] float32
    w2: torch.Tensor,  # [S, H, I] float8_e4m3fn
    w2_scale: torch.Tensor,  # [S, ceil(H/bn), ceil(I/bk)] float32
    slot_ids: torch.Tensor,  # [T, K] int, -1 = not here
    weights: torch.Tensor,  # [T, K] float32
    block: tuple[int, int] = (128, 128),
    config: MoeConfig | None = None,
    act_fp8: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H], dtype of x
    check_fp8_inputs(x, w13, w13_scale, w2, w2_scale, block)
    t, h = x.shape
    num_slots, inter = w13.shape[0], w2.shape[2]
    top_k = slot_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if t == 0 or top_k == 0:
        return out.zero_()
    cfg = (config or default_fp8_config(t, top_k, num_slots, block[1])).fitted(x.element_size())
    gu_cfg, dn_cfg = _fit(cfg.gate_up, block[1]), _fit(cfg.down, block[1])
    x = x.contiguous()
    slot_ids = slot_ids.to(torch.int32).contiguous()
    topw = weights.to(torch.float32).contiguous()
    al = align_pairs(slot_ids, num_slots, cfg.block_m)
    act = torch.empty(al.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)  # [R, I]
    _gate_up(x, w13, w13_scale, al, top_k, gu_cfg, block, act, act_fp8)
    y = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)  # [P, H]
    _down(act, w2, w2_scale, topw, al, dn_cfg, block, y, act_fp8)
    sum_k(y, slot_ids, out)
    return out


def _gate_up(x, w13, sc, al: Alignment, top_k, cfg: GemmConfig, block, act, act_fp8: bool) -> None:
    h, inter = x.shape[1], w13.shape[1] // 2
    grid = (al.max_blocks * triton.cdiv(inter, cfg.block_n),)
    _gate_up_fp8_kernel[grid](
        x, w13, sc, act, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count,
        al.max_blocks, h, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        sc.stride(0), sc.stride(1), sc.stride(2), act.stride(0),
        SCALE_N=block[0], SCALE_K=block[1],
        BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=h % cfg.block_k == 0, ACT_FP8=act_fp8, UPCAST=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _down(act, w2, sc, topw, al: Alignment, cfg: GemmConfig, block, y, act_fp8: bool) -> None:
    h, inter = w2.shape[1], w2.shape[2]
    grid = (al.max_blocks * triton.cdiv(h, cfg.block_n),)
    _down_fp8_kernel[grid](
        act, w2, sc, y, topw, al.sorted_pairs, al.block_slot, al.slot_start, al.slot_count,
        al.max_blocks, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        sc.stride(0), sc.stride(1), sc.stride(2), y.stride(0),
        SCALE_N=block[0], SCALE_K=block[1],
        BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, ACT_FP8=act_fp8, UPCAST=act.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
