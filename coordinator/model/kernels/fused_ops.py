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


@triton.jit
def _mla_rope_store_kernel(
    q_ptr,  # [T, Hq, Dn + Dr] query projection output (rotary part last)
    kva_ptr,  # [T, Rkv + Dr] kv_a projection output: latent, then the shared rotary key part
    pos_ptr,  # [T] int64
    write_ptr,  # [T] int64 cache rows
    inv_freq_ptr,  # [Dr/2] float32
    nw_ptr,  # [Rkv] kv_a_layernorm weight
    q_out_ptr,  # [T, Hq, Dr] rotated query part
    cache_ptr,  # [R, Rkv + Dr]
    eps,
    cs_scale,  # YaRN's attention factor (1.0: none)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_ot,
    stride_oh,
    stride_c,
    HQ: tl.constexpr,
    DN: tl.constexpr,
    DR: tl.constexpr,
    RKV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    ROUND_EACH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0..Hq-1: a query head's rotary part; Hq: the latent and the key part
    half = tl.arange(0, DR // 2)
    dtype = q_out_ptr.dtype.element_ty
    row = tl.load(write_ptr + t)
    if h < HQ:
        src = q_ptr + t * stride_qt + h * stride_qh + DN
    else:
        src = kva_ptr + t * stride_kt + RKV
        # the normalised latent: w * round(x * rsqrt(mean(x^2) + eps)), as RMSNorm rounds
        cols = tl.arange(0, BLOCK_C)
        cm = cols < RKV
        x = tl.load(kva_ptr + t * stride_kt + cols, mask=cm, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / RKV + eps)
        w = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        xn = (x * inv).to(dtype).to(tl.float32)
        tl.store(cache_ptr + row * stride_c + cols, (w * xn).to(dtype), mask=cm)
    if INTERLEAVE:  # pairs (0,1),(2,3).. come out as halves, as the torch path lays them out
        x1 = tl.load(src + 2 * half).to(tl.float32)
        x2 = tl.load(src + 2 * half + 1).to(tl.float32)
    else:
        x1 = tl.load(src + half).to(tl.float32)
        x2 = tl.load(src + DR // 2 + half).to(tl.float32)
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + half)  # [Dr/2]
    cos = tl.cos(freq) * cs_scale
    sin = tl.sin(freq) * cs_scale
    if ROUND_EACH:  # rotate in the activation dtype (DeepSeek-V3): round after each op as torch
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        o1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    else:  # rotate in float32, round once (DeepSeek-V2)
        o1 = (x1 * cos - x2 * sin).to(dtype)
        o2 = (x2 * cos + x1 * sin).to(dtype)
    if h < HQ:
        dst = q_out_ptr + t * stride_ot + h * stride_oh
    else:
        dst = cache_ptr + row * stride_c + RKV
    tl.store(dst + half, o1)
    tl.store(dst + DR // 2 + half, o2)


def mla_rope_store(
    q: torch.Tensor,  # [T, Hq, Dn + Dr] (a view of the projection output is fine)
    kv_a: torch.Tensor,  # [T, Rkv + Dr]
    positions: torch.Tensor,  # [T] int64
    write_index: torch.Tensor,  # [T] int64 cache rows of the new tokens
    inv_freq: torch.Tensor,  # [Dr/2] float32
    norm: tuple[torch.Tensor, float],  # kv_a_layernorm (weight [Rkv], eps)
    cache: torch.Tensor,  # [R, Rkv + Dr] this layer's latent rows
    interleave: bool,
    rope_in_float32: bool,
    cs_scale: float = 1.0,
) -> torch.Tensor:  # q_rope [T, Hq, Dr] rotated
    """MLA's small ops in one launch: RMSNorm of the latent, rotary on every head's query part
    and on the shared key part, the cache row (latent | key part) written."""
    t, hq, dq = q.shape
    rkv = norm[0].shape[0]
    dr = cache.shape[1] - rkv
    assert kv_a.shape == (t, rkv + dr) and dq > dr, f"{q.shape=} {kv_a.shape=} {cache.shape=}"
    assert (dr // 2) & (dr // 2 - 1) == 0 and dr % 2 == 0, f"rotary dim {dr} must be twice a power of two"
    assert q.stride(2) == 1 and kv_a.stride(1) == 1 and cache.stride(1) == 1
    q_rope = q.new_empty(t, hq, dr)
    if t == 0:
        return q_rope
    _mla_rope_store_kernel[(t, hq + 1)](
        q, kv_a, positions, write_index, inv_freq, norm[0], q_rope, cache, norm[1], cs_scale,
        q.stride(0), q.stride(1), kv_a.stride(0), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
        HQ=hq, DN=dq - dr, DR=dr, RKV=rkv, BLOCK_C=triton.next_power_of_2(rkv), INTERLEAVE=interleave,
        ROUND_EACH=not rope_in_float32, num_warps=4,
    )  # fmt: skip
    return q_rope
