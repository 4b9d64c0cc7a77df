"""The weighted reduction over k: out[t] = sum over k with slot_ids[t, k] >= 0 of y[t*K + k].

The routing weight is already inside ``y`` (applied by the down GEMM); the sum runs in float32 and
is rounded once to the output dtype. Tokens with no local slot get exact zeros.

Shapes: T tokens, K top-k, H hidden, P = T*K pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_k_kernel(
    y_ptr,  # [P, H]
    slot_ptr,  # [T, K]
    out_ptr,  # [T, H]
    H,
    TOP_K,
    stride_yp,
    stride_ot,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    ks = tl.arange(0, K_PAD)
    pair = t * TOP_K + ks  # [K_PAD]
    here = tl.load(slot_ptr + pair, mask=ks < TOP_K, other=-1) >= 0  # [K_PAD]
    ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + cols[None, :]  # [K_PAD, BLOCK_H]
    # rows of pairs with slot -1 hold garbage (never written): loaded anyway, so this load does
    # not wait on the slot ids, then dropped by the select (never added, so NaN cannot leak)
    rows = tl.load(ptrs, mask=(ks < TOP_K)[:, None] & (cols < H)[None, :], other=0.0)
    rows = tl.where(here[:, None], rows.to(tl.float32), 0.0)
    acc = tl.sum(rows, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_k(y: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] <- sum over local k of y [T*K, H]; every element of ``out`` is written."""
    t, top_k = slot_ids.shape
    h = out.shape[1]
    assert y.stride(1) == 1 and out.stride(1) == 1, f"{y.stride()=} {out.stride()=}"
    k_pad = triton.next_power_of_2(top_k)
    # all K rows of a column block are loaded at once: up to 16K elements in flight per program
    block_h = min(triton.next_power_of_2(h), max(256, 16384 // k_pad))
    warps = 8 if k_pad * block_h >= 8192 else 4
    _sum_k_kernel[(t, triton.cdiv(h, block_h))](
        y, slot_ids, out, h, top_k, y.stride(0), out.stride(0), K_PAD=k_pad, BLOCK_H=block_h, num_warps=warps
    )
