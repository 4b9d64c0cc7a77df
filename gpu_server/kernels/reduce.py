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
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, TOP_K):
        pair = t * TOP_K + k
        here = tl.load(slot_ptr + pair) + tl.zeros_like(cols) >= 0  # [BLOCK_H]
        # rows of pairs with slot -1 were never written: the mask keeps them out
        acc += tl.load(y_ptr + pair.to(tl.int64) * stride_yp + cols, mask=col_ok & here, other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_k(y: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, H] <- sum over local k of y [T*K, H]; every element of ``out`` is written."""
    t, top_k = slot_ids.shape
    h = out.shape[1]
    assert y.stride(1) == 1 and out.stride(1) == 1, f"{y.stride()=} {out.stride()=}"
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_k_kernel[(t, triton.cdiv(h, block_h))](
        y, slot_ids, out, h, top_k, y.stride(0), out.stride(0), BLOCK_H=block_h, num_warps=4
    )
