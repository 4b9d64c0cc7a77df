"""Fused small ops of the decoder layer (Triton), each replacing a chain of 5-20 tiny kernels.

At decode sizes every elementwise kernel costs ~1-2 us whatever its size, so the profile of
a Qwen3-30B-A3B layer at batch 1 was dominated by the ~60 small kernels around its six matrix
products. Each kernel here rounds where the plain-torch path rounds (bf16 after the norm, after
each rotary product and sum, the routing weights), so the two paths agree to within the
accumulation order.

* :func:`rmsnorm`: ``w * bf16(x * rsqrt(mean(x^2) + eps))``, optionally after ``x += residual``
  (the residual add of the decoder layer), one program per row.
* :func:`qk_norm_rope_store`: from the merged q/k/v projection output: per-head RMSNorm of q and
  k (Qwen3), rotary on q and k (half-split pairs, cos/sin computed from the positions and the
  scaled inverse frequencies, times YaRN's attention factor), q out, k and v written straight
  into this layer's KV cache rows.
* :func:`softmax_topk`: router softmax, greedy top-k, renormalisation, scaling and rounding.

Shapes: T tokens, N row width, Hq/Hk query/KV heads, D head dim, E experts, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    x_out_ptr,
    y_ptr,
    w_ptr,
    N,
    eps,
    stride_x,
    stride_r,
    stride_xo,
    stride_y,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_out_ptr.dtype.element_ty)  # rounds like x + r
        tl.store(x_out_ptr + row * stride_xo + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    xn = (xf * inv).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * xn).to(y_ptr.dtype.element_ty), mask=m)


def rmsnorm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]: normalise x + residual instead
) -> tuple[torch.Tensor, torch.Tensor]:  # (x or x + residual [T, N], normed [T, N])
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), f"{x.shape=} {weight.shape=}"
    t, n = x.shape
    y = torch.empty_like(x)
    x_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, f"{residual.shape=}"
        x_out = torch.empty_like(x)
    if t == 0:
        return x_out, y
    block = triton.next_power_of_2(n)
    r = residual if residual is not None else x
    _rmsnorm_kernel[(t,)](
        x, r, x_out, y, weight, n, eps, x.stride(0), r.stride(0), x_out.stride(0), y.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(8, max(1, block // 256)),
    )  # fmt: skip
    return x_out, y


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hk) * D]
    pos_ptr,  # [T] int64
    write_ptr,  # [T] int64 cache rows
    inv_freq_ptr,  # [D/2] float32
    qw_ptr,  # [D] q norm weight
    kw_ptr,  # [D] k norm weight
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [R, Hk, D]
    v_cache_ptr,  # [R, Hk, D]
    eps,
    cs_scale,  # YaRN's attention factor: cos and sin times it in float32, before the cast (1.0: none)
    stride_t,
    stride_qo,
    stride_kr,
    stride_vr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0..Hq-1 query heads, then Hk key heads, then Hk value heads
    half = tl.arange(0, D // 2)
    base = qkv_ptr + t * stride_t + h * D
    row = tl.load(write_ptr + t)
    dtype = q_out_ptr.dtype.element_ty
    if h >= HQ + HK:  # a value head: straight into the cache
        c = v_cache_ptr + row * stride_vr + (h - HQ - HK) * D
        tl.store(c + half, tl.load(base + half))
        tl.store(c + D // 2 + half, tl.load(base + D // 2 + half))
    else:
        x1 = tl.load(base + half).to(tl.float32)  # [D/2] first half
        x2 = tl.load(base + D // 2 + half).to(tl.float32)  # [D/2] second half
        if HAS_NORM:
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            is_q = h < HQ
            w1 = tl.where(is_q, tl.load(qw_ptr + half), tl.load(kw_ptr + half)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qw_ptr + D // 2 + half), tl.load(kw_ptr + D // 2 + half)).to(
                tl.float32
            )
            x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + half)  # [D/2]
        cos = (tl.cos(freq) * cs_scale).to(dtype).to(tl.float32)
        sin = (tl.sin(freq) * cs_scale).to(dtype).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rounded after each product and the sum as torch does
        o1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
        if h < HQ:
            c = q_out_ptr + t * stride_qo + h * D
        else:
            c = k_cache_ptr + row * stride_kr + (h - HQ) * D
        tl.store(c + half, o1)
        tl.store(c + D // 2 + half, o2)


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hk) * D] merged projection output
    hq: int,
    hk: int,
    positions: torch.Tensor,  # [T] int64
    write_index: torch.Tensor,  # [T] int64 cache rows of the new K/V
    inv_freq: torch.Tensor,  # [D/2] float32
    k_cache: torch.Tensor,  # [R, Hk, D]
    v_cache: torch.Tensor,  # [R, Hk, D]
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,  # (q weight [D], k weight [D], eps)
    cs_scale: float = 1.0,  # YaRN's attention factor (Rotary.factor)
) -> torch.Tensor:  # q [T, Hq, D]
    t = qkv.shape[0]
    d = k_cache.shape[2]
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, f"head dim {d} must be twice a power of two"
    assert qkv.shape[1] == (hq + 2 * hk) * d and qkv.stride(1) == 1, f"{qkv.shape=} {hq=} {hk=} {d=}"
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and k_cache.stride(1) == d
    q = qkv.new_empty(t, hq, d)
    if t == 0:
        return q
    qw, kw, eps = norms if norms is not None else (inv_freq, inv_freq, 0.0)
    _qk_norm_rope_store_kernel[(t, hq + 2 * hk)](
        qkv, positions, write_index, inv_freq, qw, kw, q, k_cache, v_cache, eps, cs_scale,
        qkv.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0),
        HQ=hq, HK=hk, D=d, HAS_NORM=norms is not None, num_warps=1,
    )  # fmt: skip
    return q


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,  # [T, E]
    ids_ptr,  # [T, K] int64
    w_ptr,  # [T, K] float32
    E,
    stride_l,
    scale,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORM: tl.constexpr,
    ROUND: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    lg = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)  # [BLOCK_E] softmax; padding lanes are 0
    avail = tl.where(e < E, p, -1.0)
    total = 0.0
    for _ in tl.static_range(K):  # pass 1: the sum of the top-k
        best = tl.max(avail, axis=0)
        idx = tl.min(tl.where(avail == best, e, BLOCK_E), axis=0)
        total += best
        avail = tl.where(e == idx, -1.0, avail)
    avail = tl.where(e < E, p, -1.0)
    for k in tl.static_range(K):  # pass 2: the same choice, written in descending order
        best = tl.max(avail, axis=0)
        idx = tl.min(tl.where(avail == best, e, BLOCK_E), axis=0)
        avail = tl.where(e == idx, -1.0, avail)
        w = best * scale
        if RENORM:
            w = best / total * scale
        if ROUND:
            w = w.to(logits_ptr.dtype.element_ty).to(tl.float32)
        tl.store(ids_ptr + t * K + k, idx.to(tl.int64))
        tl.store(w_ptr + t * K + k, w)


def softmax_topk(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renorm: bool,
    scale: float,
    round_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, K] int64, weights [T, K] float32
    t, e = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= e, f"{logits.shape=} {top_k=}"
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, w
    _softmax_topk_kernel[(t,)](
        logits, ids, w, e, logits.stride(0), scale,
        K=top_k, BLOCK_E=triton.next_power_of_2(e), RENORM=renorm, ROUND=round_weights, num_warps=1,
    )  # fmt: skip
    return ids, w
